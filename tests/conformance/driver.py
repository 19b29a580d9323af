"""Runs vLLM's own parsers, config and loader on CPU for the conformance tests.

Started as a child process with one installed vLLM version on PYTHONPATH (so the test
process never imports vLLM, and several versions can be checked in one run). It reads one
JSON request per line on stdin and answers one JSON line on stdout; vLLM's own logging goes
to stderr. Only code that needs no GPU is called: the `vllm preload` / `vllm serve` /
api_server argument parsers, `EngineArgs.create_engine_config`, the daemon's rank planning
and parallelism checks, `get_socket_path`, `WeightCacheKey.from_model_config` and the
`IpcModelLoader` constructor (which validates `--model-loader-extra-config`).

Each field named here is read from vLLM, never computed: the tests compare it with what
the operator, agent and webhook decided.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import traceback
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

_out = sys.stdout
sys.stdout = sys.stderr  # vLLM prints; only answers go to the real stdout

import vllm  # noqa: E402
from vllm.config.load import LoadConfig  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.entrypoints.cli.preload import PreloadSubcommand, _validate_seed_args  # noqa: E402
from vllm.entrypoints.cli.serve import ServeSubcommand  # noqa: E402
from vllm.entrypoints.common.cli_args import (  # noqa: E402
    make_arg_parser,
    validate_parsed_serve_args,
)
from vllm.model_executor.model_loader.weight_cache import daemon, protocol  # noqa: E402
from vllm.model_executor.model_loader.weight_cache.ipc_loader import IpcModelLoader  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

_parser = FlexibleArgumentParser(prog="vllm")
_subs = _parser.add_subparsers(dest="subcommand")
PreloadSubcommand().subparser_init(_subs)
ServeSubcommand().subparser_init(_subs)
_api_parser = make_arg_parser(FlexibleArgumentParser(prog="api_server"))


class ParseError(Exception):
    pass


def _parse(parser: Any, argv: list[str]) -> Any:
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        raise ParseError(f"vLLM's parser refused {argv}: exit {exc.code}") from None


def _key(cfg: Any, tp_rank: int, dp_size: int, dp_rank: int, is_draft: bool) -> dict[str, Any]:
    pc = cfg.parallel_config
    key = protocol.WeightCacheKey.from_model_config(
        cfg.model_config,
        cache_config=cfg.cache_config,
        tp_size=pc.tensor_parallel_size,
        tp_rank=tp_rank,
        pp_size=pc.pipeline_parallel_size,
        pp_rank=0,
        dp_size=dp_size,
        dp_rank=dp_rank,
        is_draft=is_draft,
        enable_expert_parallel=pc.enable_expert_parallel,
        expert_placement_strategy=pc.expert_placement_strategy,
        kernel_config=cfg.kernel_config,
    )
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(key).items()}


def preload(argv: list[str]) -> dict[str, Any]:
    """What `vllm preload` (entrypoints/cli/preload.py `cmd`) plans before it spawns."""
    args = _parse(_parser, argv)
    cfg = EngineArgs.from_cli_args(args).create_engine_config()
    if cfg.load_config.load_format == "ipc_cache":
        raise ValueError("the daemon itself must load from disk")
    pc = cfg.parallel_config
    daemon._reject_unsupported_parallelism(pc)
    placements = daemon.plan_local_ranks(pc)
    tp, pp, dp = pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.data_parallel_size
    draft = daemon.get_draft_daemon_config(cfg)
    groups = 2 if draft is not None else 1
    _validate_seed_args(args, world_size=dp * pp * tp, num_groups=groups)
    _local, dp_rank0, _pp, tp_rank0 = placements[0]
    key_dp = daemon.get_engine_dp_placement(cfg, dp_rank0)
    return {
        "placements": [list(p) for p in placements],
        "global_ranks": [d * pp * tp + p * tp + t for _l, d, p, t in placements],
        "draft_group": draft is not None,
        "master_port": args.weight_cache_master_port,
        "draft_master_port": args.weight_cache_draft_master_port,
        "socket_dir": args.weight_cache_socket_dir,
        "health": [args.weight_cache_health_host, args.weight_cache_health_port],
        "nnodes": pc.nnodes,
        "node_rank": pc.node_rank,
        "master_addr": pc.master_addr,
        "dp_address": pc.data_parallel_master_ip,
        "key": _key(cfg, tp_rank0, key_dp[0], key_dp[1], False),
    }


def serve(argv: list[str]) -> dict[str, Any]:
    """An engine command line (`vllm serve ...` or api_server flags) as the engine reads it."""
    if argv and argv[0] == "serve":
        args = _parse(_parser, argv)
        if getattr(args, "model_tag", None) is not None:  # ServeSubcommand.cmd does this
            args.model = args.model_tag
    else:  # python -m vllm.entrypoints.openai.api_server (launchers/api_server/entry.py)
        args = _parse(_api_parser, argv)
        if getattr(args, "model_tag", None) is not None:
            args.model = args.model_tag
    validate_parsed_serve_args(args)
    cfg = EngineArgs.from_cli_args(args).create_engine_config()
    out: dict[str, Any] = {
        "load_format": str(cfg.load_config.load_format),
        "extra_config": cfg.load_config.model_loader_extra_config,
        "key": _key(cfg, 0, 1, 0, False),
    }
    if out["load_format"] == "ipc_cache":
        loader = IpcModelLoader(cfg.load_config)
        out["loader"] = {
            "socket_dir": loader.socket_dir,
            "socket_path": loader.socket_path,
            "mode": loader.mode,
            "fallback": loader.fallback,
            "connect_timeout_s": loader.connect_timeout_s,
            "state_timeout_s": loader.state_timeout_s,
        }
    return out


def loader(extra: dict[str, Any]) -> dict[str, Any]:
    """Whether `IpcModelLoader` accepts this extra config (and what it read)."""
    lc = LoadConfig(load_format="ipc_cache", model_loader_extra_config=extra)
    ld = IpcModelLoader(lc)
    return {"mode": ld.mode, "socket_dir": ld.socket_dir, "is_draft": ld.is_draft}


@contextlib.contextmanager
def _fips_md5() -> Any:
    """md5 as a FIPS-mode OpenSSL offers it: refused unless usedforsecurity=False."""
    real = hashlib.md5

    def md5(data: bytes = b"", *, usedforsecurity: bool = True) -> Any:
        if usedforsecurity:
            raise ValueError("[digital envelope routines] unsupported")
        return real(data, usedforsecurity=False)

    hashlib.md5 = md5  # type: ignore[assignment]
    try:
        yield
    finally:
        hashlib.md5 = real  # type: ignore[assignment]


def socket_path(uuid: str, socket_dir: str, is_draft: bool, fips: bool) -> dict[str, Any]:
    with _fips_md5() if fips else contextlib.nullcontext():
        return {"path": protocol.get_socket_path(uuid, socket_dir, is_draft=is_draft)}


def draft_is_mtp(config: dict[str, Any]) -> dict[str, Any]:
    """vLLM's method inference for a draft checkpoint without `method` (config/speculative.py):
    `hf_config_override` rewrites the config, then `model_type in MTPModelTypes` means mtp."""
    from typing import get_args

    from transformers import PretrainedConfig
    from vllm.config.speculative import MTPModelTypes, SpeculativeConfig

    hf = PretrainedConfig(**config)
    hf.model_type = config["model_type"]
    out = SpeculativeConfig.hf_config_override(hf)
    return {"mtp": out.model_type in get_args(MTPModelTypes), "model_type": out.model_type}


OPS = {
    "draft_is_mtp": draft_is_mtp, "preload": preload, "serve": serve, "loader": loader,
    "socket_path": socket_path,
}


def main() -> None:
    _out.write(json.dumps({"ready": True, "version": vllm.__version__}) + "\n")
    _out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reply = {"ok": True, "result": OPS[req["op"]](**req["args"])}
        except Exception as exc:  # the answer is the error vLLM raised
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                     "trace": traceback.format_exc(limit=3)}
        _out.write(json.dumps(reply, default=str) + "\n")
        _out.flush()


if __name__ == "__main__":
    main()
