"""kopf handlers: one level-based reconciler per WeightCache, fed by node and agent-pod watches.

Shape of the machinery:
- kopf indexes keep every Node (summarised) and every agent pod in memory; kopf fills them
  before any other handler runs, so a restarting operator never sees an empty fleet and
  never re-places a healthy group.
- each WeightCache gets a kopf daemon that reconciles on start, whenever something relevant
  changes (spec update, a node's readiness/labels/taints/GPUs, one of its agent pods) and
  every `resync` seconds; a per-cache lock serialises reconciliations, and is held only for
  short steps: an in-place update runs as a task of its own (operator/updatetask.py).
- reconciling = validate -> place -> apply the plan ConfigMap, rendezvous Service and agent
  DaemonSet -> label agent pods with their node rank -> status, events, node labels.
- every failure to converge is visible: a write the API server rejects, agent pods the
  DaemonSet controller cannot create (FailedCreate events) and a namespace whose Pod Security
  level refuses agents all give phase Failed with the reason and the server's message in the
  conditions, and a Warning event. Objects created in a pass that then fails are deleted again,
  so no half-built group is left behind.
- deletion: kopf's finalizer holds the object until the owned objects and node labels are gone;
  one Job per node that held the cache removes its warmup and daemon state directories
  (operator/cleanup.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from weightcache import constants
from weightcache.api.v1alpha1 import WeightCacheSpec
from weightcache.contracts import seed as seed_contract
from weightcache.contracts.plan import Plan, SeedSource
from weightcache.errors import ProjectError
from weightcache.operator import (
    agentstatus,
    agentupdate,
    alignment_events,
    cleanup,
    events,
    podsecurity,
    resources,
    status,
    updatetask,
)
from weightcache.operator import nodes as node_labels
from weightcache.operator.kube import ApiError, Kube, login, path
from weightcache.operator.metrics import OperatorMetrics
from weightcache.operator.placement import NodeInfo, PlacementResult, place
from weightcache.operator.spec import name_problems, validate

registry = kopf.OperatorRegistry()
EVENT_SOURCE = "weightcache-operator"
AGENT_LABELS = {constants.LABEL_APP: constants.AGENT_APP}
CacheKey = tuple[str, str]


@dataclass(frozen=True)
class PodInfo:
    """An agent pod as the reconciler needs it."""

    name: str
    node: str
    ready: bool
    epoch: str
    plan_hash: str
    restarts: int
    rank_label: str | None
    deleting: bool
    ip: str = ""
    running: bool = False  # phase Running: its ranks are loading (or serve)

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any]) -> PodInfo:
        meta, spec, observed = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
        annotations = meta.get("annotations") or {}
        return cls(
            name=meta.get("name", ""),
            node=spec.get("nodeName") or "",
            ready=any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in observed.get("conditions") or ()
            ),
            epoch=str(annotations.get(constants.ANN_EPOCH, "")),
            plan_hash=str(annotations.get(resources.ANN_PLAN_HASH, "")),
            restarts=sum(
                int(c.get("restartCount", 0)) for c in observed.get("containerStatuses") or ()
            ),
            rank_label=(meta.get("labels") or {}).get(constants.LABEL_NODE_RANK),
            deleting=bool(meta.get("deletionTimestamp")),
            ip=observed.get("podIP") or "",
            running=observed.get("phase") == "Running",
        )


class ApplyError(ProjectError):
    """The API server refused a write of an owned object (the group is not applied)."""

    def __init__(self, kind: str, name: str, error: ApiError) -> None:
        super().__init__(f"{kind} {name} was not applied: {error}")
        self.error = error
        # 5xx, throttling and timeouts pass; anything else needs a change to the spec,
        # the cluster's policies or the operator.
        self.transient = error.status >= 500 or error.status == 429
        if error.status in (400, 422):
            self.reason = "ApplyRejected"
        elif error.status == 403:
            self.reason = "Forbidden"
        else:
            self.reason = "ApplyFailed"


@dataclass
class Pass:
    """One reconciliation of one cache: what its steps read, and what they decide in turn."""

    body: Mapping[str, Any]
    namespace: str
    name: str
    generation: Any
    previous: dict[str, Any]
    fleet: list[NodeInfo]
    labels_by_node: dict[str, Mapping[str, str]]
    spec: WeightCacheSpec
    pods: list[PodInfo]
    agents: Mapping[CacheKey, Any]
    logger: logging.Logger | logging.LoggerAdapter
    desired: dict[str, str]
    served: dict[str, str]
    placement: PlacementResult | None = None
    epoch: int = 0
    update_cond: status.Cond | None = None
    doc: Plan | None = None
    digest: str = ""
    level: str = podsecurity.PRIVILEGED
    current: dict[str, PodInfo] = field(default_factory=dict)
    states: list[status.NodeState] = field(default_factory=list)
    generations: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    seed_from: SeedSource | None = None
    seed_cond: status.Cond | None = None

    @classmethod
    def start(
        cls,
        ctl: Controller,
        body: Mapping[str, Any],
        nodes_index: Mapping[str, Any],
        agents_index: Mapping[CacheKey, Any],
        logger: logging.Logger | logging.LoggerAdapter,
    ) -> Pass:
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        key = (namespace, name)
        previous = ctl.statuses.get(key) or dict(body.get("status") or {})
        fleet = [info for store in nodes_index.values() for info in store]
        spec = WeightCacheSpec.from_spec(body.get("spec") or {}, namespace, name)
        desired = model_of(spec)
        return cls(
            body=body,
            namespace=namespace,
            name=name,
            generation=meta.get("generation"),
            previous=previous,
            fleet=fleet,
            labels_by_node={info.name: info.labels for info in fleet},
            spec=spec,
            pods=[pod for pod in (agents_index.get(key) or []) if not pod.deleting],
            agents=agents_index,
            logger=logger,
            desired=desired,
            served=dict(previous.get("model") or desired),
        )

    @property
    def key(self) -> CacheKey:
        return (self.namespace, self.name)

    @property
    def previous_nodes(self) -> list[str]:
        """The last plan's nodes by rank."""
        entries = sorted(self.previous.get("nodes") or [], key=lambda n: n["rank"])
        return [n["node"] for n in entries]

    @property
    def nodes(self) -> tuple[str, ...]:
        assert self.placement is not None
        return self.placement.nodes

    @property
    def ranks(self) -> dict[str, int]:
        return {node: rank for rank, node in enumerate(self.nodes)}

    def plan(self) -> Plan:
        """The plan of the placed group serving the revision it serves now."""
        return resources.plan(self.body, serving(self.spec, self.served), self.nodes, self.epoch,
                              self.seed_from)

    def observe_members(self) -> None:
        """Which agent pods belong to this epoch and plan, and each node's state."""
        ranks = self.ranks
        per_node = self.spec.launched_layout().ranks_per_node
        self.current = {
            pod.node: pod
            for pod in self.pods
            if pod.epoch == str(self.epoch) and pod.plan_hash == self.digest and pod.node in ranks
        }
        current = self.current
        self.states = [
            status.NodeState(
                node=node,
                rank=rank,
                ranks_total=per_node,
                pod=current[node].name if node in current else "",
                ready=node in current and current[node].ready,
                restarts=current[node].restarts if node in current else 0,
            )
            for node, rank in ranks.items()
        ]
        self.generations = {
            n["node"]: n for n in self.previous.get("nodes") or [] if n.get("pod")
        }

    def loading_nodes(self) -> list[str]:
        """Placed nodes whose current agent pod runs (its daemons load or serve)."""
        return [node for node, pod in self.current.items() if pod.running and not pod.deleting]


# Refusals of the checkpoint itself: trying the same target again cannot help, a new spec can.
NO_RETRY = frozenset({"LayoutMismatch", "BadRevision", "Unsupported"})


@dataclass
class Options:
    """Operator-wide options (from `weightcache operator` flags)."""

    agent: resources.AgentOptions = field(default_factory=resources.AgentOptions)
    resync_s: float = 30.0
    debounce_s: float = 0.05
    # Ask ready agents for bytes cached over gRPC (optional detail; readiness never needs it).
    agent_status: bool = True
    agent_status_timeout_s: float = 1.0
    # A refused or failed in-place update is tried again for the same target after this long
    # (0: never, wait for a new spec), unless the checkpoint itself was refused (NO_RETRY).
    update_retry_s: float = 300.0


@dataclass
class Controller:
    """Process-wide state shared by all handlers (kopf's global memo holds one)."""

    options: Options = field(default_factory=Options)
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    kube: Kube | None = None
    locks: dict[CacheKey, asyncio.Lock] = field(default_factory=dict)
    triggers: dict[CacheKey, asyncio.Event] = field(default_factory=dict)
    statuses: dict[CacheKey, dict[str, Any]] = field(default_factory=dict)
    # Per cache: agent address -> the last alignment miss already posted as an event.
    alignment_seen: dict[CacheKey, dict[str, int]] = field(default_factory=dict)
    ranks: dict[CacheKey, dict[str, int]] = field(default_factory=dict)
    phases: dict[CacheKey, str] = field(default_factory=dict)
    # Per cache: the update target last tried and when (monotonic seconds): the retry's clock.
    update_tries: dict[CacheKey, tuple[str, float]] = field(default_factory=dict)
    updates: updatetask.Updates = field(default_factory=updatetask.Updates)
    node_summaries: dict[str, tuple] = field(default_factory=dict)
    last_reconcile: float = 0.0
    reconciles: int = 0

    def poke(self, key: CacheKey | None = None) -> None:
        """Wake the reconciler of one cache (or all of them)."""
        targets = self.triggers.values() if key is None else [self.triggers.get(key)]
        for event in targets:
            if event is not None:
                event.set()

    def forget(self, key: CacheKey) -> None:
        for table in (self.triggers, self.statuses, self.ranks, self.phases, self.locks,
                      self.alignment_seen, self.update_tries):
            table.pop(key, None)
        self.metrics.set_phases(Counter(self.phases.values()))
        self.metrics.set_cache_phases(self.phases)

    # -- reconciliation -----------------------------------------------------------------

    async def reconcile(
        self,
        body: Mapping[str, Any],
        nodes_index: Mapping[str, Any],
        agents_index: Mapping[CacheKey, Any],
        logger: logging.Logger | logging.LoggerAdapter,
    ) -> str:
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        lock = self.locks.setdefault(key, asyncio.Lock())
        async with lock:
            started = time.monotonic()
            try:
                phase = await self._reconcile(body, nodes_index, agents_index, logger)
            except Exception:
                self.metrics.reconciles.labels(result="error").inc()
                raise
            finally:
                self.metrics.duration.observe(time.monotonic() - started)
                self.last_reconcile = time.monotonic()
                self.reconciles += 1
            self.metrics.reconciles.labels(result="ok").inc()
            self.phases[key] = phase
            self.metrics.set_phases(Counter(self.phases.values()))
            self.metrics.set_cache_phases(self.phases)
            return phase

    async def _reconcile(
        self,
        body: Mapping[str, Any],
        nodes_index: Mapping[str, Any],
        agents_index: Mapping[CacheKey, Any],
        logger: logging.Logger | logging.LoggerAdapter,
    ) -> str:
        """One pass, as named steps; a step that ends the pass returns its phase."""
        assert self.kube is not None, "the startup handler connects the client"
        run = Pass.start(self, body, nodes_index, agents_index, logger)
        for step in (self._check_spec, self._place, self._seed, self._apply_plan):
            phase = await step(run)
            if phase is not None:
                return phase
        await self._label_pods(run.namespace, run.pods, run.ranks)
        run.observe_members()
        await self._update_model(run)
        cached = await self._agent_status(run)
        return await self._report(run, cached)

    async def _check_spec(self, run: Pass) -> str | None:
        """Invalid when the name or the spec cannot be placed."""
        problems = name_problems(run.name) + validate(run.spec, run.name)
        if not problems:
            return None
        # Nothing is created or changed for a spec that cannot be placed: a previous
        # valid group keeps serving, and no half-built group appears.
        new = status.invalid(run.previous, problems, run.generation)
        await self._finish(run.body, run.key, run.previous, new, run.labels_by_node, ())
        run.logger.warning("invalid spec: %s", new["message"])
        return "Invalid"

    async def _place(self, run: Pass) -> str | None:
        """Choose the nodes (ranks are sticky), then the epoch and the served revision."""
        run.placement = place(run.previous_nodes, run.fleet, run.spec)
        if not run.placement.schedulable:
            new = status.unschedulable(
                run.previous,
                need=run.spec.parallelism.nodes,
                eligible=run.placement.eligible,
                reasons=run.placement.reasons,
                generation=run.generation,
            )
            # Keep the previous placement in memory so returning nodes get their ranks back.
            new["nodes"] = run.previous.get("nodes") or []
            new["epoch"] = run.previous.get("epoch", 0)
            await self._finish(run.body, run.key, run.previous, new, run.labels_by_node, ())
            return "Unschedulable"
        await self._advance_epoch(run)
        await self._recreate_on_new_model(run)
        return None

    async def _advance_epoch(self, run: Pass) -> None:
        """A new group starts at epoch 1; a re-placed or failed group restarts under epoch+1."""
        assert run.placement is not None
        nodes = run.spec.parallelism.nodes
        epoch = int(run.previous.get("epoch") or 0)
        if not run.previous_nodes:
            epoch = max(epoch, 1)
        elif run.placement.replaced:
            epoch += 1
            message = (
                f"re-placed the group on {status.node_list(run.placement.nodes)} (lost "
                f"{status.node_list(run.placement.replaced)}); restarting all members with epoch "
                f"{epoch}"
            )
            await self.event(run.body, "Warning", "Replaced", message)
            run.logger.warning(message)
        elif self._group_failed(run.previous, nodes, run.pods, epoch):
            epoch += 1
            message = (
                f"a member of the {nodes}-node group failed; restarting all with epoch {epoch}"
            )
            await self.event(run.body, "Warning", "GroupRestart", message)
            run.logger.warning(message)
        run.epoch = epoch

    async def _recreate_on_new_model(self, run: Pass) -> None:
        """The model revision the group serves trails spec.model until an in-place update of
        it succeeded; with updateStrategy Recreate (always for vllm) the group restarts on
        the new one at once. On runtime native the plan hash leaves the model out (so that a
        change of updateStrategy alone restarts nothing): the restart is a new epoch."""
        if run.served == run.desired or run.spec.update_type != "Recreate":
            return
        if run.spec.runtime == "native":
            run.epoch += 1
        note = (
            "runtime vllm cannot update in place (vLLM's weight-cache daemon has no update "
            "command); recreating the group on the new revision"
            if run.spec.runtime == "vllm"
            else "updateStrategy Recreate: restarting the group on the new revision"
        )
        await self.event(run.body, "Normal", "Recreating", note)
        run.served, run.update_cond = dict(run.desired), status.Cond(False, "Recreated", note)

    async def _seed(self, run: Pass) -> None:
        """Seeding new replicas (docs/warmup.md): a source gets its token Secret, a cache
        with `warmup.seed.from` the address of each node rank's peer in its plan. Never ends
        the pass: whatever stands in the way is the Seeding condition and an event."""
        spec, source = run.spec, run.spec.warmup.seed.from_
        why = seed_contract.not_applicable(spec)
        if why is not None:
            run.seed_cond = (status.Cond(False, "NotApplicable", f"no seeding from {source}: "
                                         f"{why}") if source else None)
        elif source is None:
            run.seed_cond = await self._seed_token(run)
        else:
            run.seed_from, run.seed_cond = await self._seed_peers(run, source)
        old = status.condition(run.previous, status.SEEDING)
        cond = run.seed_cond
        if cond is not None and (old or {}).get("reason") != cond.reason:
            # A source still loading, or world size 1, is expected: not a warning.
            normal = cond.status or cond.reason in ("SourceNotReady", "NotApplicable")
            await self.event(run.body, "Normal" if normal else "Warning",
                             f"Seed{cond.reason}", cond.message)
        return None

    async def _seed_token(self, run: Pass) -> status.Cond:
        """Create the source's token Secret once (create only: the operator never reads a
        Secret; AlreadyExists means it is there)."""
        assert self.kube is not None
        secret = resources.seed_secret(run.body)
        first = run.spec.ports.seed
        ports = f"{first}-{first + seed_contract.port_block(run.spec) - 1}"
        try:
            await self.kube.create(path("v1", "secrets", run.namespace), secret)
        except ApiError as exc:
            if exc.status != 409:
                return status.Cond(False, "TokenUnavailable",
                                   f"the seed token Secret {secret['metadata']['name']} cannot "
                                   f"be created ({exc}); the daemons do not serve seeds")
        except (OSError, TimeoutError) as exc:
            return status.Cond(False, "TokenUnavailable", f"the seed token Secret cannot be "
                                                          f"created ({exc}); retried next pass")
        return status.Cond(True, "Serving",
                           f"the daemons serve their autotune tables on ports {ports} to the "
                           "caches of this namespace whose spec.warmup.seed.from names this one")

    async def _seed_peers(
        self, run: Pass, source: str
    ) -> tuple[SeedSource | None, status.Cond]:
        """The ready source's agent address per node rank, or why there is none."""
        assert self.kube is not None

        def no(reason: str, message: str) -> tuple[None, status.Cond]:
            return None, status.Cond(False, reason,
                                     f"no seeding from {source}: {message}; the daemons tune "
                                     "by themselves")

        try:
            body = await self.kube.get(path(constants.API_VERSION, constants.PLURAL,
                                            run.namespace, source))
        except (ApiError, OSError, TimeoutError) as exc:
            return no("SourceUnavailable", f"cannot read it ({exc})")
        if body is None:
            return no("SourceNotFound", f"no WeightCache {source} in namespace {run.namespace}")
        src = WeightCacheSpec.from_object(body)
        observed = dict(self.statuses.get((run.namespace, source)) or body.get("status") or {})
        if validate(src, source):
            return no("SourceInvalid", "its spec is invalid")
        if src.warmup.seed.from_:
            return no("SourceIsATarget", f"it seeds from {src.warmup.seed.from_} itself and "
                                         "serves no seeds; name that cache instead")
        why = seed_contract.not_applicable(src)
        if why is not None:
            return no("SourceNotSeeding", why)
        if observed.get("model"):
            src = serving(src, observed["model"])
        differs = seed_contract.mismatch(src, serving(run.spec, run.served))
        if differs is not None:
            return no("SourceMismatch", f"vLLM seeds only between identical caches: {differs}")
        if observed.get("phase") != "Ready":
            return no("SourceNotReady", f"its phase is {observed.get('phase') or 'unknown'}")
        pods = {pod.name: pod for pod in run.agents.get((run.namespace, source)) or []
                if not pod.deleting}
        hosts = {}
        for entry in observed.get("nodes") or []:
            pod = pods.get(entry.get("pod") or "")
            if pod is not None and pod.ready and pod.ip and entry.get("ready"):
                hosts[int(entry["rank"])] = pod.ip
        if not hosts:
            return no("SourceNotReady", "none of its agent pods is ready with an address")
        n = src.parallelism.nodes
        return SeedSource(cache=source, port=int(src.ports.seed), hosts=hosts), status.Cond(
            True, "SourceReady", f"new daemons adopt the autotune tables of {source} "
                                 f"({len(hosts)} of {n} node ranks ready)")

    async def _apply_plan(self, run: Pass) -> str | None:
        """Apply the plan ConfigMap, rendezvous Service and agent DaemonSet as one group."""
        run.doc = run.plan()
        run.digest = resources.plan_hash(run.doc)
        run.level = await self._pod_security_level(run.namespace)
        try:
            await self._apply_group(
                [
                    (resources.configmap(run.body, run.doc), "v1", "configmaps"),
                    (resources.service(run.body, run.spec), "v1", "services"),
                    (
                        resources.daemonset(run.body, run.doc.spec, run.doc, run.nodes,
                                    self.options.agent),
                        "apps/v1",
                        "daemonsets",
                    ),
                ]
            )
        except ApplyError as exc:
            new = status.failed(
                run.previous, reason=exc.reason, message=str(exc), generation=run.generation
            )
            new["nodes"] = run.previous.get("nodes") or []
            new["epoch"] = run.previous.get("epoch", 0)
            await self._finish(run.body, run.key, run.previous, new, run.labels_by_node, ())
            run.logger.error("%s", exc)
            if exc.transient:
                raise  # retried with backoff
            return "Failed"
        self.ranks[run.key] = run.ranks
        return None

    async def _update_model(self, run: Pass) -> None:
        """Move the group to spec.model in place; once it serves it, rewrite the plan."""
        if run.served == run.desired and self.updates.get(run.key) is None:
            if run.update_cond is None:
                run.update_cond = self._nothing_to_update(run)
            return
        run.served, run.update_cond, updated = await self._update_in_place(
            run.key, run.body, run.previous, run.spec, run.desired, run.served, run.current,
            run.ranks)
        run.generations = {**run.generations, **updated}
        if not updated or run.served != run.desired:
            return
        try:
            await self._apply(resources.configmap(run.body, run.plan()), "v1", "configmaps")
        except ApiError as exc:
            # The daemons already committed the new revision: status must say so (or the
            # next pass would update again); the next pass's _apply_group rewrites the plan.
            error = ApplyError("ConfigMap", constants.placement_configmap_name(run.name), exc)
            message = (f"{error}; the group serves {run.served['path']}@"
                       f"{run.served['revision']} and the next pass rewrites the plan")
            await self.event(run.body, "Warning", error.reason, message)
            run.logger.error("%s", message)

    async def _agent_status(self, run: Pass) -> int | None:
        """Bytes cached by the ready agents (None: not asked), posting their alignment misses."""
        if not self.options.agent_status:
            return None
        addresses = [
            f"{pod.ip}:{run.spec.ports.grpc}" for pod in run.current.values()
            if pod.ready and pod.ip
        ]
        cached, misses = (
            await agentstatus.group_status(addresses, self.options.agent_status_timeout_s)
            if addresses
            else (0, {})
        )
        seen = self.alignment_seen.setdefault(run.key, {})
        await self.post_events(
            alignment_events.events_for(seen, run.body["metadata"], misses, EVENT_SOURCE))
        for gone in set(seen) - set(addresses):
            del seen[gone]
        return cached

    async def _report(self, run: Pass, cached: int | None) -> str:
        """The status of the applied group: Failed when agent pods cannot be created."""
        pods_seen = sum(1 for pod in run.pods if pod.node in run.ranks)
        blocked = (
            await self._pods_blocked(run.namespace, run.name, run.level, str(run.spec.runtime))
            if pods_seen == 0
            else None
        )
        if blocked is not None:
            new = status.failed(
                run.previous,
                reason=blocked[0],
                message=blocked[1],
                generation=run.generation,
                nodes=run.states,
                epoch=run.epoch,
            )
        else:
            new = status.observed(
                run.previous,
                nodes=run.states,
                pods_seen=pods_seen,
                epoch=run.epoch,
                generation=run.generation,
                bytes_cached=cached,
            )
        # The webhook warns engine pods from this; null removes a stale value (merge patch).
        new["podSecurity"] = run.level if run.level != podsecurity.PRIVILEGED else None
        new["model"] = run.served
        for entry in new["nodes"]:
            seen = run.generations.get(entry["node"]) or {}
            same_pod = seen.get("pod") == entry["pod"]
            entry["generation"] = int(seen.get("generation", 1)) if same_pod else 1
            # A partial update leaves committed nodes on the target's revision.
            entry["revision"] = str(seen.get("revision", run.served["revision"])
                                    if same_pod else run.served["revision"])
        status.with_updating(new, run.previous, run.update_cond, run.generation)
        status.with_condition(new, run.previous, status.SEEDING, run.seed_cond, run.generation,
                              carry=False)
        if (run.update_cond is not None and not run.update_cond.status
                and run.served != run.desired):
            new["message"] = run.update_cond.message
        ready_nodes = list(run.ranks) if new["phase"] == "Ready" else []
        await self._finish(run.body, run.key, run.previous, new, run.labels_by_node,
                           ready_nodes=ready_nodes, loading_nodes=run.loading_nodes())
        return new["phase"]

    @staticmethod
    def _nothing_to_update(run: Pass) -> status.Cond | None:
        """spec.model is the served revision again (a refused target reverted): the refusal
        is history, not the state of the cache. None carries an Updated/Recreated one."""
        old = next((c for c in run.previous.get("conditions") or ()
                    if c.get("type") == status.UPDATING), None)
        if old is None or old.get("reason") in ("Updated", "Recreated", "Serving"):
            return None
        served = f"{run.served['path']}@{run.served['revision']}"
        return status.Cond(False, "Serving",
                           f"spec.model is {served}, the revision the group serves: "
                           f"nothing to update (was {old.get('reason')})")

    def _retry_due(self, key: CacheKey, target: str, reason: str | None) -> bool:
        """Whether a refused or failed update to `target` may be tried again now. After an
        operator restart the first pass tries at once (no clock survives it)."""
        if reason in NO_RETRY or self.options.update_retry_s <= 0:
            return False
        tried = self.update_tries.get(key)
        return (tried is None or tried[0] != target
                or time.monotonic() - tried[1] >= self.options.update_retry_s)

    async def _update_in_place(
        self,
        key: CacheKey,
        body: Mapping[str, Any],
        previous: Mapping[str, Any],
        spec: WeightCacheSpec,
        desired: dict[str, str],
        served: dict[str, str],
        current: Mapping[str, PodInfo],
        ranks: Mapping[str, int],
    ) -> tuple[dict[str, str], status.Cond, dict[str, dict[str, Any]]]:
        """Start the in-place update of a target revision when the whole group is ready, as a
        task (operator/updatetask.py); while it runs, report its phase; once done, take its
        result. A refused or failed try is repeated every `update_retry_s` (a paused engine,
        an unreachable agent or a rollback can pass), never for a refused checkpoint
        (NO_RETRY).

        Returns the served revision, the Updating condition and the per-node generations."""
        target = f"{desired['path']}@{desired['revision']}"
        # By node rank: the first commits alone (operator/agentupdate.py).
        by_address = {f"{p.ip}:{spec.ports.grpc}": p
                      for p in sorted(current.values(), key=lambda p: ranks.get(p.node, 0))}
        running = self.updates.get(key)
        if running is not None and not running.done:
            if running.target != desired or set(running.members) != set(by_address):
                why = (f"spec.model is now {target}" if running.target != desired
                       else "the group's agents changed")
                running.ask_stop(why)
                return served, status.Cond(True, "Superseding",
                                           f"stopping the in-place update to {running.label} "
                                           f"({why}) before updating to {target}"), {}
            return served, status.Cond(True, "InProgress",
                                       f"updating in place to {target}: {running.phase} on "
                                       f"{len(running.members)} node(s)"), {}
        finished = self.updates.take(key)
        if finished is not None:
            outcome = await self._update_done(body, served, finished)
            if outcome is not None:
                return outcome
            if served == desired:  # stopped because spec.model went back to the served one
                return served, status.Cond(
                    False, "Serving", f"spec.model is {target}, the revision the group serves: "
                    f"the update to {finished.label} was stopped before COMMIT"), {}
        old = next(
            (c for c in previous.get("conditions") or () if c.get("type") == status.UPDATING),
            None,
        )
        if (old is not None and old.get("reason") not in ("Updated", "Recreated")
                and f"update to {target} " in (old.get("message") or "")
                and not self._retry_due(key, target, old.get("reason"))):
            # Refused or failed for this very target: wait for the retry or a new spec.
            return served, status.Cond(False, old["reason"], old["message"]), {}
        group_ready = len(current) == len(ranks) and all(
            p.ready and p.ip for p in current.values())
        if not group_ready:
            return served, status.Cond(True, "WaitingForGroup",
                                  f"waiting for every node to be ready to update to {target}"), {}
        if body["metadata"].get("deletionTimestamp"):
            return served, status.Cond(True, "WaitingForGroup", "the cache is being deleted"), {}
        self.update_tries[key] = (target, time.monotonic())
        started = updatetask.Running(
            target=dict(desired), members={a: (p.node, p.name) for a, p in by_address.items()})
        self.updates.start(key, started, lambda stop, progress: agentupdate.update_group(
            list(by_address), desired["path"], desired["revision"], stop=stop,
            progress=progress), lambda: self.poke(key))
        return served, status.Cond(True, "InProgress",
                                   f"updating in place to {target}: PREPARE on "
                                   f"{len(by_address)} node(s)"), {}

    async def _update_done(
        self, body: Mapping[str, Any], served: dict[str, str], done: updatetask.Running,
    ) -> tuple[dict[str, str], status.Cond, dict[str, dict[str, Any]]] | None:
        """The outcome of a finished update; None when it was stopped (nothing changed)."""
        result, target = done.result(), done.label
        node_of = {a: m[0] for a, m in done.members.items()}
        gens = {done.members[a][0]: {"pod": done.members[a][1], "generation": g,
                                     "revision": done.target["revision"]}
                for a, g in result.generations.items()}
        if result.reason == agentupdate.STOPPED:
            message = f"update to {target} stopped ({done.why_stopped}): {result.message}"
            await self.event(body, "Normal", "UpdateStopped", message)
            return None
        if result.reason == agentupdate.PARTIAL:
            on_target = ", ".join(f"{node_of[a]} generation {g}"
                                  for a, g in result.generations.items())
            others = "; ".join(f"{node_of[a]} ({a}) {what}"
                               for a, what in result.failed.items())
            message = (f"update to {target} partly failed during COMMIT: "
                       f"{done.target['path']}@{done.target['revision']} is served by "
                       f"{on_target}; not by {others}; failures: {result.message}")
            await self.event(body, "Warning", result.reason, message)
            return served, status.Cond(False, result.reason, message), gens
        if not result.ok:
            outcome = ("failed" if result.broken else "rolled back"
                       if result.reason == agentupdate.ROLLED_BACK else "refused")
            message = (f"update to {target} {outcome}: "
                       f"{result.message}; still serving {served['path']}@{served['revision']}")
            await self.event(body, "Warning", result.reason, message)
            return served, status.Cond(False, result.reason, message), {}
        message = (f"updated in place to {target} on {len(gens)} node(s), generation "
                   f"{max(result.generations.values(), default=0)}"
                   + (f"; without rollback ({result.no_rollback})" if result.no_rollback else ""))
        await self.event(body, "Normal", "Updated", message)
        return dict(done.target), status.Cond(False, "Updated", message), gens

    @staticmethod
    def _group_failed(
        previous: Mapping[str, Any], group_size: int, pods: list[PodInfo], epoch: int
    ) -> bool:
        """A member of a multi-node group restarted or lost readiness after being ready.

        A daemon group cannot re-form around survivors (the collective rendezvous happens
        once), so the whole group must restart under a new epoch.
        """
        if group_size < 2 or previous.get("epoch") != epoch:
            return False
        by_node = {pod.node: pod for pod in pods if pod.epoch == str(epoch)}
        for entry in previous.get("nodes") or []:
            if not entry.get("ready"):
                continue
            pod = by_node.get(entry["node"])
            if pod is None or pod.name != entry.get("pod"):
                return True
            if pod.restarts > int(entry.get("restarts") or 0) or not pod.ready:
                return True
        return False

    async def _apply_group(self, objects: list[tuple[dict[str, Any], str, str]]) -> None:
        """Apply the owned objects in order; on a failure delete those this pass created.

        A group is usable only whole (agents read the ConfigMap, rendezvous through the
        Service), so a rejected Service must not leave a fresh ConfigMap behind. Objects that
        existed before keep their last accepted state.
        """
        assert self.kube is not None
        created: list[str] = []
        for desired, api_version, plural in objects:
            meta = desired["metadata"]
            url = path(api_version, plural, meta["namespace"], meta["name"])
            try:
                if await self._apply(desired, api_version, plural):
                    created.append(url)
            except ApiError as exc:
                for done in reversed(created):
                    try:
                        await self.kube.delete(done)
                    except ApiError as cleanup:
                        logging.getLogger(__name__).warning(
                            "cannot roll back %s: %s", done, cleanup
                        )
                raise ApplyError(desired["kind"], meta["name"], exc) from exc

    async def _apply(self, desired: dict[str, Any], api_version: str, plural: str) -> bool:
        """Create the object, or merge-patch it when it drifted from `desired` (True: created)."""
        assert self.kube is not None
        meta = desired["metadata"]
        url = path(api_version, plural, meta["namespace"], meta["name"])
        actual = await self.kube.get(url)
        if actual is None:
            try:
                await self.kube.create(path(api_version, plural, meta["namespace"]), desired)
                return True
            except ApiError as exc:
                if exc.status != 409:
                    raise
                actual = await self.kube.get(url) or {}
        wanted = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind")}
        if not resources.contains(actual, wanted):
            await self.kube.patch(url, wanted)
        return False

    async def _pod_security_level(self, namespace: str) -> str:
        """The Pod Security level the namespace enforces; `privileged` when it cannot be read."""
        assert self.kube is not None
        try:
            ns = await self.kube.get(path("v1", "namespaces", name=namespace))
        except (ApiError, OSError, TimeoutError) as exc:
            logging.getLogger(__name__).debug("cannot read namespace %s: %s", namespace, exc)
            return podsecurity.PRIVILEGED
        return podsecurity.enforced_level(ns)

    async def _pods_blocked(
        self, namespace: str, name: str, level: str, runtime: str
    ) -> tuple[str, str] | None:
        """(reason, message) when agent pods cannot be created, or None.

        The DaemonSet controller reports a refused pod only as a `FailedCreate` Event on the
        DaemonSet (its status has no condition for it); the namespace's Pod Security label
        predicts the refusal before the first attempt.
        """
        assert self.kube is not None
        ds = constants.agent_daemonset_name(name)
        try:
            found = await self.kube.list(
                path("v1", "events", namespace),
                fieldSelector=f"involvedObject.kind=DaemonSet,involvedObject.name={ds},"
                "reason=FailedCreate",
            )
        except (ApiError, OSError, TimeoutError) as exc:
            logging.getLogger(__name__).debug("cannot list events of %s: %s", ds, exc)
            found = []
        failures = [
            e
            for e in found
            if (e.get("involvedObject") or {}).get("name") == ds
            and (e.get("involvedObject") or {}).get("kind") == "DaemonSet"
            and e.get("reason") == "FailedCreate"
        ]
        if failures:
            latest = max(failures, key=lambda e: str(e.get("lastTimestamp") or ""))
            message = str(latest.get("message") or "")
            reason = "PodSecurity" if podsecurity.is_denial(message) else "FailedCreate"
            return reason, f"agent pods are not created: DaemonSet {ds}: {message}"
        if level != podsecurity.PRIVILEGED:
            return "PodSecurity", podsecurity.blocked_message(namespace, level, runtime)
        return None

    async def _label_pods(self, namespace: str, pods: list[PodInfo], ranks: Mapping[str, int]):
        """Give each agent pod its node-rank label (the rendezvous Service selects rank 0)."""
        assert self.kube is not None
        for pod in pods:
            want = str(ranks[pod.node]) if pod.node in ranks else None
            if pod.rank_label == want:
                continue
            try:
                await self.kube.patch(
                    path("v1", "pods", namespace, pod.name),
                    {"metadata": {"labels": {constants.LABEL_NODE_RANK: want}}},
                )
            except ApiError as exc:
                # Status must still be reported; without the label only the rendezvous
                # Service lacks its endpoint (RBAC: the operator needs `patch` on pods).
                logging.getLogger(__name__).warning(
                    "cannot label pod %s/%s with its node rank: %s", namespace, pod.name, exc
                )

    async def _finish(
        self,
        body: Mapping[str, Any],
        key: CacheKey,
        previous: Mapping[str, Any],
        new: dict[str, Any],
        labels_by_node: Mapping[str, Mapping[str, str]],
        ready_nodes: Any,
        loading_nodes: Any = (),
    ) -> None:
        assert self.kube is not None
        namespace, name = key
        # Invalid, Unschedulable and Failed statuses are built without the served revision,
        # the Pod Security level or the Updating condition: carry them, or the next pass
        # would take spec.model as served and skip a refused or pending update.
        for carried in ("model", "podSecurity"):
            if carried not in new and carried in previous:
                new[carried] = previous[carried]
        if not any(c.get("type") == status.UPDATING for c in new.get("conditions") or ()):
            status.with_updating(new, previous, None, None)
        if not any(c.get("type") == status.SEEDING for c in new.get("conditions") or ()):
            status.with_condition(new, previous, status.SEEDING, None, None)
        await node_labels.sync_labels(self.kube, namespace, name, labels_by_node, ready_nodes,
                                      loading_nodes)
        if not status.same(previous, new):
            await self.kube.patch(
                path(constants.API_VERSION, constants.PLURAL, namespace, name, "status"),
                {"status": new},
            )
            event = status.transition_event(previous, new)
            if event:
                await self.event(body, *event)
        self.statuses[key] = new

    async def post_events(self, bodies: list[dict[str, Any]]) -> None:
        """Post ready-made core/v1 Events (best effort, like `event`)."""
        assert self.kube is not None
        for event in bodies:
            try:
                await self.kube.create(events.events_path(event["metadata"]["namespace"]), event)
            except (TimeoutError, ApiError, OSError) as exc:
                logging.getLogger(__name__).warning("event %s not posted: %s",
                                                    event["reason"], exc)

    async def event(self, body: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        """Post a core/v1 Event about the cache (best effort: a lost event is only logged)."""
        assert self.kube is not None
        meta = body["metadata"]
        event = events.event_body(
            events.cache_ref(meta), type_=kind, reason=reason, message=message,
            component=EVENT_SOURCE,
        )
        await self.post_events([event])

    async def cleanup(self, body: Mapping[str, Any], nodes_index: Mapping[str, Any]) -> None:
        """Delete owned objects (ownerReferences would too, but not before the finalizer
        goes) and remove the node labels."""
        assert self.kube is not None
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        # A pass in flight finishes first (short: updates run beside it), then the update
        # of this cache is stopped and its aborts awaited: no engine stays paused.
        async with self.locks.setdefault((namespace, name), asyncio.Lock()):
            pass
        await self.updates.stop((namespace, name), "the cache is being deleted")
        await self.kube.delete(
            path("apps/v1", "daemonsets", namespace, constants.agent_daemonset_name(name))
        )
        await self.kube.delete(
            path("v1", "services", namespace, constants.rendezvous_service_name(name))
        )
        await self.kube.delete(
            path("v1", "configmaps", namespace, constants.placement_configmap_name(name))
        )
        labels_by_node = {
            info.name: info.labels for store in nodes_index.values() for info in store
        }
        label = constants.node_ready_label(namespace, name)
        await self._clean_host_dirs(body, [n for n, lb in labels_by_node.items() if label in lb])
        await node_labels.sync_labels(self.kube, namespace, name, labels_by_node, ())
        self.forget((namespace, name))

    async def _clean_host_dirs(self, body: Mapping[str, Any], labelled: list[str]) -> None:
        """One Job per node that held the cache removes its warmup and daemon state
        directories (operator/cleanup.py). Never blocks the deletion: a refused Job is a
        Warning event."""
        assert self.kube is not None
        spec = WeightCacheSpec.from_object(body)
        if validate(spec):
            return
        dirs = cleanup.targets(body, spec)
        if not dirs:
            return
        meta = body["metadata"]
        status_ = dict(self.statuses.get((meta["namespace"], meta["name"]))
                       or body.get("status") or {})
        for node in cleanup.nodes_to_clean(status_, labelled):
            job = cleanup.job(body, spec, node, self.options.agent)
            try:
                await self.kube.create(path("batch/v1", "jobs", meta["namespace"]), job)
            except (ApiError, OSError, TimeoutError) as exc:
                if isinstance(exc, ApiError) and exc.status == 409:
                    continue  # this cache's Job for the node exists already
                await self.event(body, "Warning", "CleanupFailed",
                                 f"the host directories {', '.join(dirs)} on node {node} are "
                                 f"not removed: Job {job['metadata']['name']}: {exc}")


def model_of(spec: WeightCacheSpec) -> dict[str, str]:
    """The model revision a spec asks for, as status.model records it."""
    return {"path": str(spec.model.path or ""), "revision": str(spec.model.revision or "")}


def serving(spec: WeightCacheSpec, served: Mapping[str, str]) -> WeightCacheSpec:
    """`spec` with the model revision the group actually serves."""
    return spec.with_model(served["path"], served.get("revision") or None)


def controller(memo: Any) -> Controller:
    return memo["controller"]


# -- kopf wiring ------------------------------------------------------------------------


@kopf.on.login(registry=registry)
def _login(**_: Any) -> kopf.ConnectionInfo:
    """Service account in a pod, else KUBECONFIG, read now (not when kopf was imported)."""
    return login()


@kopf.on.startup(registry=registry)
async def _startup(memo: Any, **_: Any) -> None:
    ctl = controller(memo)
    if ctl.kube is None:
        ctl.kube = Kube.connect()


@kopf.on.cleanup(registry=registry)
async def _cleanup(memo: Any, **_: Any) -> None:
    ctl = controller(memo)
    await ctl.updates.stop_all("the operator is stopping")
    if ctl.kube is not None:
        await ctl.kube.close()
        ctl.kube = None


@kopf.index("v1", "nodes", registry=registry)
def nodes_index(name: str, body: Mapping[str, Any], **_: Any) -> dict[str, NodeInfo]:
    return {name: NodeInfo.from_node(body)}


@kopf.index("v1", "pods", labels=AGENT_LABELS, registry=registry)
def agents_index(
    namespace: str, labels: Mapping[str, str], body: Mapping[str, Any], **_: Any
) -> dict[CacheKey, PodInfo] | None:
    cache = labels.get(constants.LABEL_CACHE)
    if not cache:
        return None
    return {(namespace, cache): PodInfo.from_pod(body)}


@kopf.on.event("v1", "nodes", registry=registry)
def _node_event(type: str, name: str, body: Mapping[str, Any], memo: Any, **_: Any) -> None:
    ctl = controller(memo)
    summary = None if type == "DELETED" else NodeInfo.from_node(body).summary()
    if ctl.node_summaries.get(name) != summary:
        if summary is None:
            ctl.node_summaries.pop(name, None)
        else:
            ctl.node_summaries[name] = summary
        ctl.poke()
        ctl.metrics.nodes.set(len(ctl.node_summaries))


@kopf.on.event("v1", "pods", labels=AGENT_LABELS, registry=registry)
def _pod_event(namespace: str, labels: Mapping[str, str], memo: Any, **_: Any) -> None:
    cache = labels.get(constants.LABEL_CACHE)
    if cache:
        controller(memo).poke((namespace, cache))


@kopf.on.update(
    constants.GROUP, constants.VERSION, constants.PLURAL, field="spec", registry=registry
)
def _spec_changed(namespace: str, name: str, memo: Any, **_: Any) -> None:
    controller(memo).poke((namespace, name))


@kopf.daemon(
    constants.GROUP, constants.VERSION, constants.PLURAL, registry=registry,
    cancellation_timeout=10,
)
async def _reconciler(
    stopped: Any,
    body: Mapping[str, Any],
    namespace: str,
    name: str,
    memo: Any,
    nodes_index: Any,
    agents_index: Any,
    logger: Any,
    **_: Any,
) -> None:
    ctl = controller(memo)
    key = (namespace, name)
    trigger = ctl.triggers.setdefault(key, asyncio.Event())
    failures = 0
    while not stopped:
        trigger.clear()
        try:
            await ctl.reconcile(body, nodes_index, agents_index, logger)
            failures = 0
        except Exception as exc:  # keep the loop alive; the error is counted and logged
            failures += 1
            logger.exception("reconciliation failed (attempt %d): %s", failures, exc)
        timeout = ctl.options.resync_s if not failures else min(2.0**failures, ctl.options.resync_s)
        wakeup = asyncio.ensure_future(trigger.wait())
        stop = asyncio.ensure_future(stopped.wait())
        try:
            await asyncio.wait({wakeup, stop}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            wakeup.cancel()
            stop.cancel()
        # Let a burst of watch events settle into one reconciliation.
        await asyncio.sleep(ctl.options.debounce_s)


@kopf.on.delete(constants.GROUP, constants.VERSION, constants.PLURAL, registry=registry)
async def _deleted(
    body: Mapping[str, Any], memo: Any, nodes_index: Any, logger: Any, **_: Any
) -> None:
    await controller(memo).cleanup(body, nodes_index)
    logger.info("owned objects and node labels removed")


def configure(settings: kopf.OperatorSettings) -> None:
    """Settings every run of this operator uses (main.py adds peering and logging)."""
    # Handler progress lives in annotations; status belongs to the reconciler alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=constants.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=constants.GROUP, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{constants.GROUP}/finalizer"
    # Only our own events (kopf.event) and real warnings reach the API.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    # Only agent pods, filtered by the API server: a cluster's other pods never reach us.
    settings.watching.label_selectors["v1", "pods"] = f"{constants.LABEL_APP}={constants.AGENT_APP}"
