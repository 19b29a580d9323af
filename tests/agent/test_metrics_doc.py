"""The metrics table of docs/interfaces.md is the one list of the agent's series: every series
`agent/metrics.py` exports is a row there (and no row names a series that does not exist)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def exported() -> set[str]:
    """Every family name the agent's collectors create (counters and info without suffix)."""
    names = set()
    for module in ("metrics.py", "alignment.py"):
        source = (ROOT / "agent" / module).read_text()
        names |= set(re.findall(r"\"(weightcache_[a-z_]+)\"", source))
    return names


def documented() -> set[str]:
    text = (ROOT / "docs" / "interfaces.md").read_text()
    table = text[text.index("## Metrics (Prometheus naming)"):text.index("Operator: `weightcache_")]
    rows = re.findall(r"^\| `(weightcache_[a-z_]+)` \|", table, flags=re.M)
    return {re.sub(r"_(total|info)$", "", row) for row in rows}


def test_the_interfaces_table_lists_exactly_the_agents_series():
    names = exported()
    assert len(names) >= 15, names  # the regex still finds the families
    assert documented() == names


def test_the_other_docs_link_to_the_table_instead_of_repeating_it():
    for doc in ("agent.md", "updates.md", "alignment.md"):
        text = (ROOT / "docs" / doc).read_text()
        assert "docs/interfaces.md" in text, doc
        assert not re.search(r"^\| `weightcache_", text, flags=re.M), doc
