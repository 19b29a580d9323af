"""The node agent: the process in each agent pod of a WeightCache group (`weightcache agent`).

It reads its configuration (downward API, the placement plan), launches the runtime's daemon
launcher (`runtimes/`: `vllm preload` or the native `weightcache preload`), supervises its
ranks (`supervisor`), and serves gRPC status and health (`grpc_service`), HTTP probes
(`health`) and Prometheus metrics (`metrics`).

May import: `weightcache.constants`, `weightcache.api` (the plan's typed spec),
`weightcache.contracts`, `weightcache.errors`, and the torch-free modules of
`weightcache.native` (protocol, identity, gpu, security, lifetime: the socket protocol, device
identities and socket-directory checks the daemons use, so both sides check the same way).
Never the operator, `bench` or `testing`: agents and the operator meet only through the plan
and the gRPC API. (`client` is the deprecated engine import, a re-export of the native client.)
"""
