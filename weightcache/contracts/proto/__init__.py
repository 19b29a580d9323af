"""The agent's gRPC API (`agent.proto`; generated modules, `make proto`): the agent serves it,
the operator reads agent status through it. May import: protobuf and grpc only."""
