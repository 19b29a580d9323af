"""The node agent: the process in each agent pod of a WeightCache group (`weightcache agent`).

It reads its configuration (downward API, the placement plan), launches the runtime's daemon
launcher (`runtimes/`: `vllm preload` or the native `weightcache preload`), supervises its
ranks (`supervisor`), and serves gRPC status and health (`grpc_service`), HTTP probes
(`health`) and Prometheus metrics (`metrics`).

What it may import is stated once, in `.importlinter` (docs/interfaces.md, "Packages"): the
typed API (`weightcache.api`, the plan's spec), contracts, errors, and the native cache's own
checks (socket protocol, device identities, socket-directory checks, the update coordinator) so
that both sides check the same way, and only modules of it that import no torch. (`client` is
the deprecated engine import, a re-export.)
"""
