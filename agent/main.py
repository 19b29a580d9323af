"""`weightcache agent`: the process in each agent pod of a WeightCache group.

Start-up order matters for clear failures: configuration (environment, plan, devices) and
the runtime's command line are validated first, then the socket directory, then the ports;
only then is the daemon launched. Each refusal is one log line and a distinct exit code
(docs/agent.md) so the pod restarts and `kubectl describe` says why.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import threading
from typing import Any

from weightcache.agent import config as agent_config
from weightcache.agent.config import AgentConfig, ConfigError
from weightcache.agent.supervisor import (
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_PORT,
    EXIT_RUNTIME,
    Policy,
    Supervisor,
)
from weightcache.native.shared import security

log = logging.getLogger("weightcache.agent")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightcache agent", description=__doc__.split("\n")[0])
    p.add_argument("--plan", help="placement plan file (default: $WEIGHTCACHE_PLAN or "
                   "/etc/weightcache/plan.json)")
    p.add_argument("--bind", help="address for gRPC and HTTP (default: $POD_IP)")
    p.add_argument("--load-timeout", type=float, default=None,
                   help="seconds a load may take before the daemons count as hung")
    p.add_argument("--backoff", type=float, default=1.0, help="first restart backoff (s)")
    p.add_argument("--max-load-failures", type=int, default=3)
    p.add_argument("--log-level", default=os.environ.get("WEIGHTCACHE_LOG_LEVEL", "INFO"))
    return p


def ensure_socket_dir(path: str) -> None:
    """Make the group's socket directory private to our uid and prove we can create files in it.

    The directory checks are the daemons' (`security.prepare_socket_dir`); the agent owns the
    directory, so it tightens an existing one to 0700 rather than refusing it.
    """
    try:
        security.prepare_socket_dir(path, make_private=True)
        fd, probe = tempfile.mkstemp(prefix=".agent-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except security.SecurityError as exc:
        raise ConfigError(f"socket dir {path} refused: {exc} (set runAs or fix the hostPath "
                          "owner)") from None
    except OSError as exc:
        raise ConfigError(f"socket dir {path} is not writable: {exc.strerror or exc}") from exc


def start_alignment(cfg: AgentConfig, ranks: list) -> Any:
    """Publish the GPU map engines align to and start counting their reports."""
    from weightcache.agent.alignment import ReportServer, publish_map

    reports = ReportServer(cfg)
    try:
        log.info("published GPU map %s", publish_map(cfg, ranks))
        reports.start()
    except OSError as exc:  # engines then start unaligned; the daemons are unaffected
        log.warning("GPU alignment unavailable: %s", exc)
    return reports


def _startup(args: argparse.Namespace) -> AgentConfig:
    environ = dict(os.environ)
    if args.plan:
        environ["WEIGHTCACHE_PLAN"] = args.plan
    if args.load_timeout is not None:
        environ["WEIGHTCACHE_LOAD_TIMEOUT_S"] = str(args.load_timeout)
    return agent_config.load(environ)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = _startup(args)
    except ConfigError as exc:
        log.error("configuration refused: %s", exc)
        return EXIT_CONFIG
    from weightcache.agent.runtimes import get_runtime  # after config: runtime imports vary

    try:
        runtime = get_runtime(cfg)
        argv0 = runtime.command()[0]
    except ConfigError as exc:
        log.error("configuration refused: %s", exc)
        return EXIT_CONFIG
    if not (shutil.which(argv0) or (os.path.isfile(argv0) and os.access(argv0, os.X_OK))):
        log.error("runtime %s: binary %r not found or not executable", runtime.name, argv0)
        return EXIT_RUNTIME
    try:
        ensure_socket_dir(cfg.socket_dir)
    except ConfigError as exc:
        log.error("%s", exc)
        return EXIT_RUNTIME
    from weightcache.agent import warmup

    warm = warmup.prepare(cfg)
    runtime.warmup_root = warm.path or None
    watch = warmup.Watch(warm, str(cfg.spec.warmup.cache_dir))
    reports = start_alignment(cfg, runtime.ranks())
    log.info("cache %s/%s (uid %s) node %s: node rank %d of %d, %d local rank(s) on %s, "
             "epoch %d, runtime %s", cfg.env.namespace, cfg.env.cache, cfg.plan.uid or "?",
             cfg.env.node, cfg.node_rank, cfg.node_count, len(runtime.ranks()),
             ",".join(d.uuid for d in cfg.devices), cfg.plan.epoch, runtime.name)

    from weightcache.agent.grpc_service import GrpcServer
    from weightcache.agent.health import serve_http
    from weightcache.agent.metrics import build_registry

    stop = threading.Event()
    policy = Policy(backoff_initial=args.backoff, max_load_failures=args.max_load_failures)
    grpc_server: Any = None

    def on_change() -> None:
        if grpc_server is not None:
            grpc_server.update_health()

    sup = Supervisor(cfg, runtime, policy, on_fatal=lambda code, why: stop.set(),
                     on_change=on_change, on_launch=watch.launched)
    host = args.bind or cfg.env.pod_ip
    try:
        registry = build_registry(cfg, sup, warm)
        registry.register(reports.collector())
        http = serve_http(host, cfg.ports["metrics"], registry, lambda: sup.alive, sup.ready)
    except OSError as exc:
        log.error("metrics/health port %s:%d unavailable: %s", host, cfg.ports["metrics"], exc)
        reports.stop()
        return EXIT_PORT
    try:
        grpc_server = GrpcServer(cfg, sup, host, cfg.ports["grpc"], alignment=reports,
                                 warmup=warm)
    except OSError as exc:
        log.error("gRPC port %s:%d unavailable: %s", host, cfg.ports["grpc"], exc)
        http.shutdown()
        reports.stop()
        return EXIT_PORT
    grpc_server.start()
    log.info("serving gRPC on %s:%d and HTTP (/metrics, /healthz, /readyz) on %s:%d",
             host, cfg.ports["grpc"], host, cfg.ports["metrics"])

    def on_signal(signum: int, frame: object) -> None:
        log.info("received %s: stopping", signal.Signals(signum).name)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    sup.start()
    try:
        while not stop.wait(1.0):
            grpc_server.update_health()
            watch.tick(sup.ready())
    finally:
        grpc_server.update_health()
        sup.stop()
        grpc_server.stop()
        http.shutdown()
        reports.stop()
        for s, handler in old.items():
            with contextlib.suppress(ValueError):
                signal.signal(s, handler)
    code = sup.exit_code if sup.exit_code is not None else EXIT_OK
    log.info("agent stopped (exit %d)", code)
    return code
