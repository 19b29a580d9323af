"""weightcache: keep model weights resident on each node so restarting engines map them."""

__version__ = "0.1.0"
