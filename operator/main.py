"""`weightcache operator`: run the kopf operator (reconciler and, when present, admission webhooks).

Replicas coordinate through kopf peering (one reconciles, the others stand by); `/healthz` is
kopf's own liveness endpoint, `/metrics` a Prometheus endpoint of our own.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import secrets
import sys
from types import ModuleType

import kopf

from weightcache.operator import handlers
from weightcache.operator.metrics import serve as serve_metrics
from weightcache.operator.resources import DEFAULT_AGENT_IMAGE, DEFAULT_AGENT_REQUESTS, AgentOptions

logger = logging.getLogger("weightcache.operator")


def _admission() -> ModuleType | None:
    """The admission webhook module, if this build has it."""
    try:
        return importlib.import_module("weightcache.operator.admission")
    except ImportError:
        return None


def replica_priority(given: int | None) -> int:
    """The kopf peering priority of this replica.

    kopf lets the replica with the highest priority reconcile and pauses the rest; replicas of
    equal priority would all pause. Replicas of one Deployment cannot be told apart in their
    arguments, so each draws its own at start-up unless one is given.
    """
    if given is not None:
        return given
    return secrets.randbelow(1_000_000) + 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightcache operator", description=__doc__.splitlines()[0])
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace", "-n", action="append", default=[], help="watch this namespace (repeatable)"
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch all namespaces")
    peer = p.add_mutually_exclusive_group()
    peer.add_argument("--peering", default=None, help="ClusterKopfPeering name (leader election)")
    peer.add_argument("--standalone", action="store_true", help="no peering (a single replica)")
    p.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority of this replica (default: a random one per process, since "
        "kopf pauses every replica when two share the highest priority)",
    )
    p.add_argument("--log-format", choices=("json", "text"), default="json")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    p.add_argument("--metrics-host", default="0.0.0.0")
    p.add_argument("--metrics-port", type=int, default=8080, help="/metrics port (0: off)")
    p.add_argument("--health-port", type=int, default=8081, help="/healthz port (0: off)")
    p.add_argument("--agent-image", default=DEFAULT_AGENT_IMAGE, help="image of agent pods")
    p.add_argument("--agent-image-pull-policy", default="IfNotPresent")
    p.add_argument("--agent-runtime-class", default=None, help="RuntimeClass of GPU agent pods")
    p.add_argument("--agent-service-account", default=None, help="ServiceAccount of agent pods")
    p.add_argument(
        "--agent-priority-class",
        default=None,
        help="PriorityClass of agent pods (a cache's spec.placement.priorityClassName wins)",
    )
    p.add_argument(
        "--agent-cpu-request",
        default=DEFAULT_AGENT_REQUESTS["cpu"],
        help="CPU request of agent containers without spec.resources.requests.cpu ('' for none)",
    )
    p.add_argument(
        "--agent-memory-request",
        default=DEFAULT_AGENT_REQUESTS["memory"],
        help="memory request of agent containers without spec.resources.requests.memory",
    )
    p.add_argument("--resync-seconds", type=float, default=30.0, help="periodic reconcile")
    p.add_argument("--update-retry-seconds", type=float, default=300.0,
                   help="retry a refused or failed in-place update after this long (0: never; "
                        "a refused layout or revision waits for a new spec)")
    p.add_argument(
        "--no-agent-status",
        action="store_true",
        help="do not ask agents for bytes cached over gRPC (readiness comes from pods)",
    )
    p.add_argument(
        "--no-scanning",
        action="store_true",
        help="skip kopf's CRD/namespace scanning (the CRD must exist at start)",
    )
    p.add_argument("--no-webhook", action="store_true", help="serve no admission webhooks")
    admission = _admission()
    if admission is not None:
        admission.add_arguments(p)
    return p


def options_from_args(args: argparse.Namespace) -> handlers.Options:
    return handlers.Options(
        agent=AgentOptions(
            image=args.agent_image,
            image_pull_policy=args.agent_image_pull_policy,
            runtime_class=args.agent_runtime_class,
            service_account=args.agent_service_account,
            priority_class=args.agent_priority_class or None,
            requests={
                key: value
                for key, value in (
                    ("cpu", args.agent_cpu_request),
                    ("memory", args.agent_memory_request),
                )
                if value
            },
        ),
        resync_s=args.resync_seconds,
        update_retry_s=args.update_retry_seconds,
        agent_status=not args.no_agent_status,
    )


def build_registry(args: argparse.Namespace) -> kopf.OperatorRegistry:
    """The reconciler's registry, plus the admission handlers when webhooks are enabled."""
    registry = handlers.registry
    admission = _admission()
    if admission is None or args.no_webhook:
        return registry
    if getattr(args, "webhook_disabled", False):
        return registry
    admission.register(registry, admission.AdmissionConfig.from_args(args))
    return registry


async def run(
    args: argparse.Namespace,
    *,
    registry: kopf.OperatorRegistry | None = None,
    stop_flag: asyncio.Event | None = None,
    ready_flag: asyncio.Event | None = None,
    controller: handlers.Controller | None = None,
) -> None:
    """Run the operator until `stop_flag` is set (or forever); tests call this directly."""
    ctl = controller or handlers.Controller(options=options_from_args(args))
    settings = kopf.OperatorSettings()
    handlers.configure(settings)
    settings.scanning.disabled = args.no_scanning
    metrics_runner = None
    if args.metrics_port:
        metrics_runner = await serve_metrics(
            ctl.metrics, host=args.metrics_host, port=args.metrics_port
        )
    liveness = f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None
    try:
        await kopf.operator(
            registry=registry if registry is not None else build_registry(args),
            settings=settings,
            clusterwide=args.all_namespaces or not args.namespace,
            namespaces=args.namespace,
            standalone=args.standalone or not args.peering,
            peering_name=args.peering,
            priority=replica_priority(args.priority),
            liveness_endpoint=liveness,
            memo=kopf.Memo(controller=ctl),
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        )
    finally:
        if metrics_runner is not None:
            await metrics_runner.cleanup()


def _configure_logging(args: argparse.Namespace) -> None:
    kopf.configure(
        debug=args.log_level == "debug",
        verbose=args.log_level in ("debug", "info"),
        quiet=args.log_level in ("warning", "error"),
        log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.FULL,
        log_refkey="object",
    )
    logging.getLogger().setLevel(args.log_level.upper())


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if not args.namespace and not args.all_namespaces and os.environ.get("WATCH_NAMESPACE"):
        args.namespace = os.environ["WATCH_NAMESPACE"].split(",")
    _configure_logging(args)
    try:
        asyncio.run(run(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the last log line says why the operator stopped
        logger.exception("operator stopped: %s", exc)
        print(f"weightcache operator: {exc}", file=sys.stderr)
        return 1
    return 0
