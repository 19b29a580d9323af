"""The native weight cache: a per-device daemon on the node and the client library in the engine.

One folder per side of the data path, and what both share:

- `daemon/`: on the node, `launcher` (`weightcache preload`) starts one `rank` process per
  device; each loads its shard into one arena and serves it over a Unix socket (`server`),
  and rewrites it in place on an update (`updater`).
- `engine/`: in the engine, `attach` maps that arena or falls back to disk (the public face is
  `weightcache.client`); `attach_command` is the same thing as a command; `participant` takes
  part in in-place updates.
- `shared/`: the checkpoint, sharding and arena layout, the socket protocol and its checks,
  identities, fingerprints, content digests, the transports, and the error root.
- `coordinator`: `weightcache update` and `push_update`, a client of every rank of a node.

What may import what is stated once, in `.importlinter` (contracts `native` and `native-sides`):
engines import this package without the operator or the node agent installed.
"""
