"""Contracts shared by the operator and the node agent: each one written once.

- `plan`: the placement plan the operator writes into the plan ConfigMap and the agent reads;
- `layout`: the one parallel layout type (`Layout`), from the spec's `parallelism` to vLLM's
  flags, and which global, tensor-parallel and data-parallel rank each device serves;
- `ranks`: the older names of the rank layout (compatibility re-exports of `layout`);
- `vocabulary`: dtypes, loader modes, model roles, exit codes;
- `alignment`: which visible GPU each engine rank should use (the GPU map, and the code
  engines run at start-up; standard library only, its source is published to engines);
- `proto`: the agent's gRPC API (generated code, `make proto`).

May import: the standard library, `weightcache.constants`, `weightcache.errors` and (for the
plan's typed spec) `weightcache.api`, so every side (operator, agent, native daemon, engine
client) can depend on it without pulling in the others.
"""
