"""One vLLM process's view of the warmup caches, with vLLM's (and FlashInfer's) own functions.

Run as a fresh interpreter per process it stands for (FlashInfer resolves its directories at
import time), with the exact environment the agent gives `vllm preload` or the webhook gives
the engine:

    python warmup_probe.py '[{"argv": [...], "ranks": [0, 1], "dp_rank": 0}]'

prints one JSON line (a list: one view per command line). The config is built as both
commands build it, `EngineArgs.from_cli_args(args).create_engine_config(usage_context=
OPENAI_API_SERVER)` (preload.py and serve use that usage context; without it the hash differs).
"""

from __future__ import annotations

import json
import os
import sys
import types


def main() -> None:
    """Each request is one command line of this process's environment."""
    out = [view(req) for req in json.loads(sys.argv[1])]
    print("OUT " + json.dumps(out), flush=True)


def view(req: dict) -> dict:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli.preload import PreloadSubcommand
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    subs = parser.add_subparsers(dest="subcommand")
    PreloadSubcommand().subparser_init(subs)
    ServeSubcommand().subparser_init(subs)
    args = parser.parse_args(req["argv"])
    if req["argv"][0] == "serve":
        args.model = args.model_tag
    cfg = EngineArgs.from_cli_args(args).create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER)
    # The per-rank table is keyed by the world rank and DP rank a worker holds.
    import vllm.distributed.parallel_state as ps

    world = cfg.parallel_config.world_size
    cfg.parallel_config.data_parallel_rank = req.get("dp_rank", 0)
    import vllm.envs as envs
    from flashinfer import autotune_cache
    from vllm.compilation.backends import hash_factors
    from vllm.compilation.caching import aot_compile_hash_factors
    from vllm.model_executor.warmup import flashinfer_autotune_cache as fac
    from vllm.v1.worker import startup_plan

    runner = types.SimpleNamespace(vllm_config=cfg)
    tables = []
    for rank in req.get("ranks", [0]):
        ps.get_world_group = lambda rank=rank: types.SimpleNamespace(rank_in_group=rank,
                                                                     world_size=world)
        tables.append(str(fac.resolve_rank_flashinfer_autotune_file(runner)))
    v2 = fac.resolve_flashinfer_autotune_v2_root()
    return {
        "tables": tables,
        "table_hash": fac.flashinfer_autotune_cache_hash(runner),
        "v2_root": str(v2 if v2 is not None else autotune_cache.get_default_cache_root()),
        "config_hash": cfg.compute_hash(),
        "env_hash": hash_factors(envs.compile_factors()),
        "aot_hash": str(aot_compile_hash_factors(cfg)),
        "cache_root": envs.VLLM_CACHE_ROOT,
        "plan": startup_plan._plan_path("0" * 16),
        "plan_enabled": bool(envs.VLLM_ENABLE_STARTUP_PLAN),
        "seed_token": getattr(args, "seed_token", None),
        "pid": os.getpid(),
    }


if __name__ == "__main__":
    main()
