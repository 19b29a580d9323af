"""The native weight cache: a per-device daemon on the node and the client library in the engine.

Two sides of one data path live here. On the node, `launcher` (`weightcache preload`) starts
one `daemon` process per device; each loads its shard (`checkpoint`, `sharding`, `loader`,
`coldload`) into one arena, fingerprints it (`fingerprint`), and serves it over a Unix socket
(`protocol`, `security`, `identity`) through a `transport` (memfd on CPU, CUDA VMM or legacy
IPC on GPU). In the engine, `client` attaches to that arena or falls back to disk, and
`attach` is the same thing as a command.

May import: `weightcache.constants`, `weightcache.contracts`, torch, safetensors, numpy,
msgpack. Never the operator, the node agent, `bench` or `testing`: engines import this
package without either of those installed. The engine-facing API is `weightcache.client`.
"""
