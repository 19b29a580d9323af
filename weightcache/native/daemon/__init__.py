"""The node side: `launcher` (`weightcache preload`) starts one `rank` process per device; each
loads its shard into one arena and serves it (`rank`), and rewrites it in place on an update
(`updater`). `python -m weightcache.native.daemon` runs one rank (`__main__`).

Imports `shared`, never `engine` (`.importlinter`, contract `native-sides`).
"""
