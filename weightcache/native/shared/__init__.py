"""What both sides of the native cache build on: the checkpoint, its sharding and arena layout,
the socket protocol and its security checks, device identities, fingerprints, content digests,
the transports, and the one error root of the cache.

Imports neither `daemon` nor `engine` (`.importlinter`, contract `native-sides`), so each side
can change without the other.
"""
