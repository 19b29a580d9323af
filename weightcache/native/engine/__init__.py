"""The engine side: what an inference engine imports to take its weights from the cache
(`attach`: load or fall back to disk, `materialize`), the `weightcache attach` command
(`attach_command`), which device each rank should use (`rank_devices`), and taking part in
in-place updates (`participant`). The public face is `weightcache.client`.

Imports `shared`, never `daemon` (`.importlinter`, contract `native-sides`).
"""
