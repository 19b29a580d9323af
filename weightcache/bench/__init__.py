"""Benchmarks and the demo: `weightcache bench` (`report`) and its sections, `weightcache demo`.

Development tooling, not product: no product package imports this one, and the images do not
ship it. It may import every product package and `weightcache.testing`.
"""
