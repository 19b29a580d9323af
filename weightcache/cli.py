"""The `weightcache` command: one entry point, each subcommand owned by its module.

Subcommands are imported lazily so that `weightcache operator` never pays for torch and
`weightcache preload` never imports kopf.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "preload": ("weightcache.native.daemon.launcher",
                "native weight cache daemon (one rank per device)"),
    "attach": ("weightcache.native.engine.attach_command",
               "attach like a restarting engine, print one JSON line"),
    "update": ("weightcache.native.coordinator", "update running daemons in place to a new model"),
    "import-set": ("weightcache.native.daemon.seedset",
                   "record the import set a node's first start reads ahead (image build)"),
    "digest": ("weightcache.native.shared.content",
               "full content digest of a checkpoint (for an audit)"),
    "bench": ("weightcache.bench.report", "benchmarks: attach vs. disk load, operator, admission"),
    "demo": ("weightcache.bench.demo", "end-to-end demo on a generated checkpoint"),
    "agent": ("weightcache.agent.main", "node agent: supervise daemon ranks, gRPC, metrics"),
    "operator": ("weightcache.operator.main", "the kopf operator (reconciler and webhooks)"),
    "crds": ("weightcache.operator.crd", "print or write the CustomResourceDefinition YAML"),
}


def _usage() -> str:
    lines = ["usage: weightcache <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:  # like argparse without a required subcommand: usage on stderr, exit 2
        print(f"{_usage()}\n\nweightcache: error: a command is required", file=sys.stderr)
        return 2
    if args[0] in {"-h", "--help"}:
        print(_usage())
        return 0
    if args[0] == "--version":
        from weightcache import __version__

        print(__version__)
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"weightcache: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    result = module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
