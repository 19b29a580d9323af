"""weightcache: keep model weights resident on each node so restarting engines map them.

The rooms (docs/interfaces.md, "Packages"; `.importlinter` enforces who may import whom):
`operator` (from `operator/`) and `agent` (from `agent/`) never import each other and meet in
`contracts` (placement plan, rank layout, vocabulary, gRPC); `native` is the weight cache
itself (daemon, launcher, engine client), below both; `client` is the engine-facing import;
`constants` holds names shared with the chart; `cli` dispatches `weightcache <command>`;
`bench` and `testing` are development tooling that no product module imports.
"""

__version__ = "0.1.0"
