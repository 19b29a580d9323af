"""The one root of every error this project raises on purpose.

Each package keeps its own error root (the client's `WeightCacheError`, the operator's spec
and plan errors, the agent's configuration errors, the daemon's start-up errors), and each of
those derives from `ProjectError`, so a caller that embeds several components can tell "this
project refused" from a bug with one `except`. Import-free, so every layer may import it.
"""

from __future__ import annotations


class ProjectError(Exception):
    """Something weightcache refused or could not do; the message says what and why."""
