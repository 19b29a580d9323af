"""Contracts shared by the operator and the node agent: each one written once.

- `plan`: the placement plan the operator writes into the plan ConfigMap and the agent reads;
- `ranks`: which global, tensor-parallel and data-parallel rank each device of a node serves;
- `vocabulary`: dtypes, loader modes, model roles, exit codes;
- `proto`: the agent's gRPC API (generated code, `make proto`).

May import: the standard library and `weightcache.constants` only, so every side (operator,
agent, native daemon, engine client) can depend on it without pulling in the others.
"""
