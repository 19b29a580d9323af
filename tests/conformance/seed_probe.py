"""One side of vLLM's seed channel, with vLLM's own parser, validation and SeedTransport.

Run as a fresh interpreter per side, with the environment the agent gives `vllm preload`:

    python seed_probe.py source '{"argv": [...], "rank": 1, "table": {...}}'
    python seed_probe.py target '{"argvs": [[...], [...]], "rank": 1}'

Both parse the agent's argv with vLLM's preload parser (which expands `--config FILE.yaml`)
and pass `_validate_seed_args`, as `vllm preload` does before it spawns a daemon. The source
writes `table` where its daemon's warmup would (the engine's per-rank path under its
VLLM_CACHE_ROOT), starts vLLM's listener on `--seed-listen-port + rank` and prints
`READY {...}`, then serves until stdin closes. The target adopts through vLLM's
`FlashInferWarmupCache` from `--seed-source-port + rank` once per command line and prints
`OUT [...]`: the parsed seed arguments and what is installed at its own per-rank path after
each. What vLLM does on a GPU around this (the daemon's warmup, `flashinfer_autotune`) is
not run: tests/gpu and docs/warmup.md.
"""

from __future__ import annotations

import json
import sys
import types

SEED_FIELDS = ("seed_listen_host", "seed_listen_port", "seed_source_host", "seed_source_port",
               "seed_token")


def parse(argv: list[str]):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli.preload import PreloadSubcommand, _validate_seed_args
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    PreloadSubcommand().subparser_init(parser.add_subparsers(dest="subcommand"))
    args = parser.parse_args(argv)
    cfg = EngineArgs.from_cli_args(args).create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER)
    par = cfg.parallel_config
    world = par.data_parallel_size * par.pipeline_parallel_size * par.tensor_parallel_size
    _validate_seed_args(args, world_size=world, num_groups=1)
    return args, cfg, world


def runner(cfg, rank: int, world: int):
    import vllm.distributed.parallel_state as ps

    ps.get_world_group = lambda: types.SimpleNamespace(rank_in_group=rank, world_size=world)
    return types.SimpleNamespace(vllm_config=cfg)


def main() -> None:
    from vllm.model_executor.model_loader.weight_cache.seed import SeedConfig, SeedTransport
    from vllm.model_executor.model_loader.weight_cache.warmup_cache import FlashInferWarmupCache
    from vllm.model_executor.warmup import flashinfer_autotune_cache as fac

    role, req = sys.argv[1], json.loads(sys.argv[2])
    rank = req["rank"]
    if role == "source":
        args, cfg, world = parse(req["argv"])
        run = runner(cfg, rank, world)
        path = fac.resolve_rank_flashinfer_autotune_file(run)
        fac.write_flashinfer_autotune_cache(path, json.dumps(req["table"]).encode())
        listen = (args.seed_listen_host, args.seed_listen_port + rank)
        transport = SeedTransport([FlashInferWarmupCache()],
                                  SeedConfig(listen=listen, token=args.seed_token))
        bound = transport.start_listener()
        print("READY " + json.dumps({"args": {k: getattr(args, k) for k in SEED_FIELDS},
                                     "bound": list(bound), "path": str(path)}), flush=True)
        sys.stdin.read()
        transport.close()
        return
    out = []
    for argv in req["argvs"]:
        args, cfg, world = parse(argv)
        run = runner(cfg, rank, world)
        source = (args.seed_source_host, args.seed_source_port + rank)
        cache = FlashInferWarmupCache()
        SeedTransport([cache], SeedConfig(source=source, token=args.seed_token)).adopt(cache, run)
        path = fac.resolve_rank_flashinfer_autotune_file(run)
        out.append({"args": {k: getattr(args, k) for k in SEED_FIELDS}, "path": str(path),
                    "installed": path.read_text() if path.exists() else None})
    print("OUT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
