"""The kube-apiserver validation rules this project relies on, as a checked-in list with sources.

kmock stores whatever it is sent; a real API server answers 422 to objects that break its
validation. This module is the tests' stand-in for that validation, limited to the rules the
objects this project writes can break (names, labels, node selector terms, tolerations, probes,
volumes, ports, env, Services, DaemonSets, ConfigMaps, Events, status conditions, structural
pruning of the WeightCache schema). It is NOT a copy of Kubernetes: each check restates one rule
and `RULES` names where the real rule lives, so a reviewer can compare the two. Paths are in
github.com/kubernetes/kubernetes (apimachinery and pod-security-admission under staging/src).

`check(obj)` returns the violations of one object as the API server would see it after a
create, or after a merge patch is applied (`merge_patch`). The tests hook it into kmock
(tests/operator/conftest.py) so every write the operator sends is judged, and rejected with
422 like the real server would, and run it over the objects built for every chart example and
for the extreme specs the CRD schema allows (tests/operator/test_apirules.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

CORE = "pkg/apis/core/validation/validation.go"
APIMACHINERY = "staging/src/k8s.io/apimachinery/pkg/util/validation/validation.go"
META = "staging/src/k8s.io/apimachinery/pkg/api/validation/objectmeta.go"
META_V1 = "staging/src/k8s.io/apimachinery/pkg/apis/meta/v1/validation/validation.go"
APPS = "pkg/apis/apps/validation/validation.go"
BATCH = "pkg/apis/batch/validation/validation.go"
EVENTS = "pkg/apis/core/validation/events.go"
DS_UTIL = "pkg/controller/daemon/util/daemonset_util.go"
PSA = "staging/src/k8s.io/pod-security-admission/policy"


@dataclass(frozen=True)
class Rule:
    """One validation rule of the real API server (or controller) and where it lives."""

    id: str
    summary: str
    source: str


RULES: dict[str, Rule] = {
    r.id: r
    for r in (
        Rule(
            "name.subdomain",
            "object names (ConfigMap, DaemonSet, Pod, Event, Node, WeightCache) are DNS-1123 "
            "subdomains: <= 253 chars, lowercase alphanumerics, '-' and '.'",
            f"{META} NameIsDNSSubdomain -> {APIMACHINERY} IsDNS1123Subdomain",
        ),
        Rule(
            "name.service",
            "Service names are DNS-1035 labels: <= 63 chars, start with a letter "
            "(Kubernetes <= 1.35; 1.36's relaxed rule accepts a subset of what this accepts)",
            f"{CORE} ValidateServiceName = NameIsDNS1035Label -> {APIMACHINERY} IsDNS1035Label",
        ),
        Rule(
            "name.namespace",
            "namespaces are DNS-1123 labels (<= 63)",
            f"{META} ValidateNamespaceName -> {APIMACHINERY} IsDNS1123Label",
        ),
        Rule(
            "meta.labels",
            "label keys are qualified names (optional DNS-subdomain prefix, name <= 63, "
            "[A-Za-z0-9][-A-Za-z0-9_.]*[A-Za-z0-9]); values <= 63 of the same charset or empty",
            "staging/src/k8s.io/apimachinery/pkg/apis/meta/v1/validation ValidateLabels -> "
            f"{APIMACHINERY} IsQualifiedName, IsValidLabelValue",
        ),
        Rule(
            "meta.annotations",
            "annotation keys are qualified names; all annotations together <= 256 KiB",
            f"{META} ValidateAnnotations (TotalAnnotationSizeLimitB)",
        ),
        Rule(
            "meta.owner",
            "ownerReferences need apiVersion, kind, name and uid; at most one controller",
            f"{META} validateOwnerReference, ValidateOwnerReferences",
        ),
        Rule(
            "pod.container-name",
            "container and init container names are DNS-1123 labels, unique across both lists",
            f"{CORE} validateContainers / validateInitContainers (IsDNS1123Label, Duplicate)",
        ),
        Rule(
            "pod.image",
            "every container has a non-empty image",
            f"{CORE} validateContainerCommon (Required image)",
        ),
        Rule(
            "pod.ports",
            "containerPort 1..65535; port names are IANA service names (<= 15, [-a-z0-9], "
            "a letter, no '--', no leading/trailing '-') and unique in the container",
            f"{CORE} validateContainerPorts -> {APIMACHINERY} IsValidPortNum, IsValidPortName",
        ),
        Rule(
            "pod.env",
            "env names are C-identifier-like ([-._a-zA-Z][-._a-zA-Z0-9]*, not '.'/'..'); a "
            "fieldRef names a supported field path",
            f"{CORE} ValidateEnv, validateObjectFieldSelector (validEnvDownwardAPIFieldPath"
            f"Expressions) -> {APIMACHINERY} IsEnvVarName",
        ),
        Rule(
            "pod.volumes",
            "volume names are DNS-1123 labels and unique; each volume has exactly one source; "
            "hostPath needs a path and a known type",
            f"{CORE} ValidateVolumes, validateVolumeSource, validateHostPathVolumeSource, "
            "validateHostPathType",
        ),
        Rule(
            "pod.mounts",
            "a volumeMount names an existing volume and a non-empty mountPath, unique per "
            "container",
            f"{CORE} ValidateVolumeMounts",
        ),
        Rule(
            "pod.probes",
            "a probe has exactly one handler; grpc port 1..65535; timing fields >= 0 (period, "
            "timeout, thresholds >= 1 once defaulted); liveness successThreshold must be 1",
            f"{CORE} validateProbe, validateHandler / handlerFromProbe, validateLivenessProbe",
        ),
        Rule(
            "pod.node-selector",
            "nodeSelector keys and values are valid label keys and values",
            f"{CORE} ValidatePodSpec -> ValidateLabels(spec.NodeSelector)",
        ),
        Rule(
            "pod.affinity.terms",
            "required node affinity has at least one term; matchExpressions: key a label name, "
            "In/NotIn need values, Exists/DoesNotExist none, Gt/Lt exactly one; values label "
            "values",
            f"{CORE} ValidateNodeSelector, ValidateNodeSelectorTerm, "
            "ValidateNodeSelectorRequirement",
        ),
        Rule(
            "pod.affinity.preferred",
            "preferred node affinity: each weight an integer in 1..100; its preference a node "
            "selector term under the same rules as a required one",
            f"{CORE} ValidatePreferredSchedulingTerms",
        ),
        Rule(
            "pod.affinity.match-fields",
            "matchFields: only key metadata.name, operator In or NotIn with exactly ONE value, "
            "a valid node name",
            f"{CORE} validateNodeFieldSelectorRequirement (nodeFieldSelectorValidators)",
        ),
        Rule(
            "pod.tolerations",
            "toleration key a label name; empty key needs operator Exists; Equal (or empty) "
            "needs a label-value value, Exists an empty one; effect NoSchedule, PreferNoSchedule "
            "or NoExecute (or empty); tolerationSeconds only with NoExecute",
            f"{CORE} ValidateTolerations, validateTaintEffect",
        ),
        Rule(
            "pod.security-context",
            "runAsUser/runAsGroup within 0..2147483647; runAsNonRoot true with runAsUser 0 is "
            "rejected at container start (kubelet), so the builder never writes it",
            f"{CORE} ValidatePodSecurityContext -> {APIMACHINERY} IsValidUserID, IsValidGroupID",
        ),
        Rule(
            "pod.priority-class",
            "priorityClassName is a DNS-1123 subdomain",
            f"{CORE} ValidatePodSpec (ValidateDNS1123Subdomain on PriorityClassName)",
        ),
        Rule(
            "daemonset.selector",
            "spec.selector is required, non-empty and selects the template's labels; "
            "template restartPolicy Always",
            f"{APPS} ValidateDaemonSetSpec",
        ),
        Rule(
            "job.spec",
            "a Job's pod template has restartPolicy OnFailure or Never; backoffLimit and "
            "ttlSecondsAfterFinished >= 0, activeDeadlineSeconds > 0",
            f"{BATCH} ValidateJobSpec, validatePodTemplateSpec (restartPolicy)",
        ),
        Rule(
            "daemonset.update",
            "rollingUpdate.maxUnavailable: int >= 0 or a percent <= 100%; maxUnavailable and "
            "maxSurge not both 0",
            f"{APPS} ValidateRollingUpdateDaemonSet",
        ),
        Rule(
            "service.ports",
            "Service ports 1..65535, protocol TCP/UDP/SCTP, names DNS-1123 labels, required and "
            "unique when there are several; selector labels valid",
            f"{CORE} ValidateService, validateServicePort",
        ),
        Rule(
            "secret.data",
            "Secret keys match [-._a-zA-Z0-9]+ (<= 253), values are base64 (the decoded data "
            "together <= 1 MiB); type is a qualified name",
            f"{CORE} ValidateSecret -> {APIMACHINERY} IsConfigMapKey",
        ),
        Rule(
            "pod.secret-volume",
            "a secret volume names its secretName; defaultMode and item modes are 0..0777, "
            "item keys valid and item paths relative without '..'",
            f"{CORE} validateSecretVolumeSource, validateKeyToPath",
        ),
        Rule(
            "configmap.data",
            "ConfigMap keys match [-._a-zA-Z0-9]+ (<= 253); all data together <= 1 MiB",
            f"{CORE} ValidateConfigMap -> {APIMACHINERY} IsConfigMapKey",
        ),
        Rule(
            "event.namespace",
            "an Event without eventTime lives in its involvedObject's namespace",
            f"{EVENTS} legacyValidateEvent",
        ),
        Rule(
            "condition",
            "conditions: type a qualified name, status True/False/Unknown, lastTransitionTime "
            "set, reason non-empty <= 1024 matching ^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$, "
            "message <= 32768",
            f"{META_V1} ValidateCondition (API conventions: metav1.Condition)",
        ),
        Rule(
            "crd.pruning",
            "fields of a custom resource that its structural schema does not declare are "
            "silently pruned (the write succeeds, the field is gone)",
            "staging/src/k8s.io/apiextensions-apiserver/pkg/apiserver/schema/pruning/"
            "algorithm.go Prune",
        ),
        Rule(
            "crd.defaults",
            "a default in a structural schema must itself validate against its schema (type, "
            "enum, bounds, pattern) and survive pruning; it is applied when an object is "
            "decoded (requests and reads from etcd), only where the parent object is present",
            "Kubernetes docs, Extend the Kubernetes API with CustomResourceDefinitions, "
            "\"Defaulting\" (staging/src/k8s.io/apiextensions-apiserver/pkg/apiserver/schema/"
            "defaulting/validation.go ValidateDefaults, algorithm.go Default)",
        ),
        Rule(
            "object.size",
            "one object is at most etcd's default request limit, 1.5 MiB",
            "etcd server/embed/config.go DefaultMaxRequestBytes (kube-apiserver stores through it)",
        ),
        Rule(
            "daemonset.tolerations",
            "the DaemonSet controller adds tolerations for not-ready/unreachable NoExecute, "
            "disk/memory/pid-pressure and unschedulable NoSchedule, and network-unavailable "
            "NoSchedule only for hostNetwork pods",
            f"{DS_UTIL} AddOrUpdateDaemonPodTolerations",
        ),
        Rule(
            "podsecurity.baseline",
            "Pod Security baseline forbids hostPath volumes, hostPID/hostIPC/hostNetwork, "
            "privileged containers and capabilities beyond the baseline set",
            f"{PSA}/check_hostPathVolumes.go, check_hostNamespaces.go, check_privileged.go, "
            "check_capabilities_baseline.go",
        ),
    )
}


@dataclass(frozen=True)
class Violation:
    rule: str
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message} [{self.rule}: {RULES[self.rule].source}]"


# ---------------------------------------------------------------------------- primitives

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
PORT_NAME = re.compile(r"^[-a-z0-9]+$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
CONFIGMAP_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
CONDITION_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
PERCENT = re.compile(r"^[0-9]+%$")
HOSTPATH_TYPES = {
    "",
    "DirectoryOrCreate",
    "Directory",
    "FileOrCreate",
    "File",
    "Socket",
    "CharDevice",
    "BlockDevice",
}
ENV_FIELD_PATHS = {
    "metadata.name",
    "metadata.namespace",
    "metadata.uid",
    "spec.nodeName",
    "spec.serviceAccountName",
    "status.hostIP",
    "status.hostIPs",
    "status.podIP",
    "status.podIPs",
}
VOLUME_SOURCES = {
    "hostPath",
    "emptyDir",
    "gcePersistentDisk",
    "awsElasticBlockStore",
    "gitRepo",
    "secret",
    "nfs",
    "iscsi",
    "glusterfs",
    "persistentVolumeClaim",
    "rbd",
    "flexVolume",
    "cinder",
    "cephfs",
    "flocker",
    "downwardAPI",
    "fc",
    "azureFile",
    "configMap",
    "vsphereVolume",
    "quobyte",
    "azureDisk",
    "photonPersistentDisk",
    "projected",
    "portworxVolume",
    "scaleIO",
    "storageos",
    "csi",
    "ephemeral",
    "image",
}
MAX_INT32 = 2147483647
MAX_OBJECT_BYTES = 1536 * 1024
# Lowest accepted value of each probe field once the API server has defaulted it.
PROBE_MINIMUM = {
    "initialDelaySeconds": 0,
    "timeoutSeconds": 1,
    "periodSeconds": 1,
    "successThreshold": 1,
    "failureThreshold": 1,
    "terminationGracePeriodSeconds": 1,
}


def is_dns1123_label(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= 63 and bool(DNS1123_LABEL.match(v))


def is_dns1035_label(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= 63 and bool(DNS1035_LABEL.match(v))


def is_dns1123_subdomain(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= 253 and bool(DNS1123_SUBDOMAIN.match(v))


def is_qualified_name(v: Any) -> bool:
    if not isinstance(v, str) or not v:
        return False
    prefix, _, name = v.rpartition("/")
    if "/" in v and not is_dns1123_subdomain(prefix):
        return False
    return len(name) <= 63 and bool(QUALIFIED_NAME.match(name))


def is_label_value(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= 63 and bool(LABEL_VALUE.match(v))


def is_port_name(v: Any) -> bool:
    return (
        isinstance(v, str)
        and 0 < len(v) <= 15
        and bool(PORT_NAME.match(v))
        and re.search("[a-z]", v) is not None
        and "--" not in v
        and not v.startswith("-")
        and not v.endswith("-")
    )


def is_port(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 65535


# ---------------------------------------------------------------------------- checks


class _Out:
    def __init__(self) -> None:
        self.items: list[Violation] = []

    def add(self, rule: str, field: str, message: str) -> None:
        assert rule in RULES, rule
        self.items.append(Violation(rule, field, message))

    def need(self, ok: bool, rule: str, field: str, message: str) -> None:
        if not ok:
            self.add(rule, field, message)


def _labels(out: _Out, labels: Any, field: str) -> None:
    for key, value in (labels or {}).items():
        if value is None:  # a merge patch removing the label
            continue
        out.need(is_qualified_name(key), "meta.labels", f"{field}[{key}]", "invalid label key")
        out.need(
            is_label_value(value), "meta.labels", f"{field}[{key}]", f"invalid value {value!r}"
        )


def _metadata(out: _Out, meta: Mapping[str, Any], kind: str, namespaced: bool) -> None:
    name = meta.get("name", "")
    if kind == "Service":
        out.need(is_dns1035_label(name), "name.service", "metadata.name", f"{name!r}")
    else:
        out.need(is_dns1123_subdomain(name), "name.subdomain", "metadata.name", f"{name!r}")
    if namespaced:
        ns = meta.get("namespace", "")
        out.need(is_dns1123_label(ns), "name.namespace", "metadata.namespace", f"{ns!r}")
    _labels(out, meta.get("labels"), "metadata.labels")
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if v is not None}
    for key in annotations:
        out.need(is_qualified_name(key), "meta.annotations", f"metadata.annotations[{key}]", "key")
    size = sum(len(k) + len(str(v)) for k, v in annotations.items())
    out.need(size <= 256 * 1024, "meta.annotations", "metadata.annotations", f"{size} bytes")
    owners = meta.get("ownerReferences") or []
    for i, ref in enumerate(owners):
        for key in ("apiVersion", "kind", "name", "uid"):
            out.need(
                bool(ref.get(key)), "meta.owner", f"metadata.ownerReferences[{i}].{key}", "required"
            )
    controllers = sum(1 for ref in owners if ref.get("controller"))
    out.need(controllers <= 1, "meta.owner", "metadata.ownerReferences", "several controllers")


def _probe(out: _Out, probe: Any, field: str, liveness: bool) -> None:
    if probe is None:
        return
    handlers = [k for k in ("exec", "httpGet", "tcpSocket", "grpc") if probe.get(k) is not None]
    out.need(len(handlers) == 1, "pod.probes", field, f"needs exactly one handler, has {handlers}")
    if "grpc" in handlers:
        out.need(is_port(probe["grpc"].get("port")), "pod.probes", f"{field}.grpc.port", "1..65535")
    for key, low in PROBE_MINIMUM.items():
        value = probe.get(key)
        if value is not None:
            ok = isinstance(value, int) and value >= low
            out.need(ok, "pod.probes", f"{field}.{key}", f"must be >= {low}")
    if liveness and probe.get("successThreshold") not in (None, 1):
        out.need(False, "pod.probes", f"{field}.successThreshold", "must be 1")


def _container(out: _Out, c: Mapping[str, Any], field: str, volumes: set[str]) -> None:
    out.need(bool(str(c.get("image") or "").strip()), "pod.image", f"{field}.image", "required")
    names: set[str] = set()
    for i, port in enumerate(c.get("ports") or []):
        pf = f"{field}.ports[{i}]"
        out.need(is_port(port.get("containerPort")), "pod.ports", f"{pf}.containerPort", "1..65535")
        if port.get("name") is not None:
            out.need(is_port_name(port["name"]), "pod.ports", f"{pf}.name", repr(port["name"]))
            out.need(port["name"] not in names, "pod.ports", f"{pf}.name", "duplicate")
            names.add(port["name"])
        out.need(port.get("protocol", "TCP") in ("TCP", "UDP", "SCTP"), "pod.ports", pf, "protocol")
    for i, env in enumerate(c.get("env") or []):
        ef = f"{field}.env[{i}]"
        name = env.get("name")
        out.need(
            isinstance(name, str) and bool(ENV_NAME.match(name)) and name not in (".", ".."),
            "pod.env",
            f"{ef}.name",
            repr(name),
        )
        ref = (env.get("valueFrom") or {}).get("fieldRef")
        if ref is not None:
            path = ref.get("fieldPath", "")
            ok = path in ENV_FIELD_PATHS or re.match(
                r"^metadata\.(labels|annotations)\[.+\]$", path
            )
            out.need(bool(ok), "pod.env", f"{ef}.valueFrom.fieldRef.fieldPath", repr(path))
    paths: set[str] = set()
    for i, mount in enumerate(c.get("volumeMounts") or []):
        mf = f"{field}.volumeMounts[{i}]"
        out.need(mount.get("name") in volumes, "pod.mounts", f"{mf}.name", "not a volume")
        path = mount.get("mountPath") or ""
        out.need(bool(path), "pod.mounts", f"{mf}.mountPath", "required")
        out.need(path not in paths, "pod.mounts", f"{mf}.mountPath", "duplicate")
        paths.add(path)
    _probe(out, c.get("livenessProbe"), f"{field}.livenessProbe", liveness=True)
    _probe(out, c.get("readinessProbe"), f"{field}.readinessProbe", liveness=False)
    _probe(out, c.get("startupProbe"), f"{field}.startupProbe", liveness=True)


def _node_selector_terms(out: _Out, required: Any, field: str) -> None:
    terms = (required or {}).get("nodeSelectorTerms")
    out.need(bool(terms), "pod.affinity.terms", f"{field}.nodeSelectorTerms", "at least one term")
    for t, term in enumerate(terms or []):
        _node_selector_term(out, term, f"{field}.nodeSelectorTerms[{t}]")


def _preferred_terms(out: _Out, preferred: Any, field: str) -> None:
    for t, entry in enumerate(preferred or []):
        tf = f"{field}[{t}]"
        weight = entry.get("weight")
        out.need(isinstance(weight, int) and not isinstance(weight, bool) and 1 <= weight <= 100,
                 "pod.affinity.preferred", f"{tf}.weight", f"{weight!r} not in 1..100")
        _node_selector_term(out, entry.get("preference") or {}, f"{tf}.preference")


def _node_selector_term(out: _Out, term: Any, tf: str) -> None:
    for i, req in enumerate(term.get("matchExpressions") or []):
        rf = f"{tf}.matchExpressions[{i}]"
        op, values = req.get("operator"), req.get("values") or []
        out.need(
            is_qualified_name(req.get("key")), "pod.affinity.terms", f"{rf}.key", "label name"
        )
        if op in ("In", "NotIn"):
            out.need(bool(values), "pod.affinity.terms", f"{rf}.values", "required")
        elif op in ("Exists", "DoesNotExist"):
            out.need(not values, "pod.affinity.terms", f"{rf}.values", "must be empty")
        elif op in ("Gt", "Lt"):
            out.need(len(values) == 1, "pod.affinity.terms", f"{rf}.values", "one value")
        else:
            out.add("pod.affinity.terms", f"{rf}.operator", f"{op!r} is not an operator")
        for v in values:
            out.need(is_label_value(v), "pod.affinity.terms", f"{rf}.values", repr(v))
    for i, req in enumerate(term.get("matchFields") or []):
        rf = f"{tf}.matchFields[{i}]"
        out.need(
            req.get("key") == "metadata.name",
            "pod.affinity.match-fields",
            f"{rf}.key",
            f"{req.get('key')!r} is not a valid field selector key",
        )
        out.need(
            req.get("operator") in ("In", "NotIn"),
            "pod.affinity.match-fields",
            f"{rf}.operator",
            repr(req.get("operator")),
        )
        values = req.get("values") or []
        out.need(
            len(values) == 1,
            "pod.affinity.match-fields",
            f"{rf}.values",
            "Required value: must be only one value when `operator` is 'In' or 'NotIn' "
            f"for node field selector (got {len(values)})",
        )
        for v in values:
            out.need(
                is_dns1123_subdomain(v), "pod.affinity.match-fields", f"{rf}.values", repr(v)
            )


def _tolerations(out: _Out, tolerations: Any, field: str) -> None:
    for i, tol in enumerate(tolerations or []):
        tf = f"{field}[{i}]"
        key, op = tol.get("key") or "", tol.get("operator") or ""
        if key:
            out.need(is_qualified_name(key), "pod.tolerations", f"{tf}.key", repr(key))
        if not key:
            out.need(
                op == "Exists", "pod.tolerations", f"{tf}.operator", "Exists when key is empty"
            )
        if tol.get("tolerationSeconds") is not None:
            out.need(
                tol.get("effect") == "NoExecute",
                "pod.tolerations",
                f"{tf}.effect",
                "NoExecute when tolerationSeconds is set",
            )
        if op in ("Equal", ""):
            out.need(
                is_label_value(tol.get("value") or ""),
                "pod.tolerations",
                f"{tf}.value",
                "label value",
            )
        elif op == "Exists":
            out.need(not tol.get("value"), "pod.tolerations", f"{tf}.value", "empty with Exists")
        else:
            out.add("pod.tolerations", f"{tf}.operator", f"{op!r} not supported")
        effect = tol.get("effect") or ""
        out.need(
            effect in ("", "NoSchedule", "PreferNoSchedule", "NoExecute"),
            "pod.tolerations",
            f"{tf}.effect",
            repr(effect),
        )


def pod_spec(out: _Out, spec: Mapping[str, Any], field: str) -> None:
    """The PodSpec rules (a Pod's spec or a DaemonSet's template spec)."""
    volumes: set[str] = set()
    for i, vol in enumerate(spec.get("volumes") or []):
        vf = f"{field}.volumes[{i}]"
        name = vol.get("name")
        out.need(is_dns1123_label(name), "pod.volumes", f"{vf}.name", repr(name))
        out.need(name not in volumes, "pod.volumes", f"{vf}.name", "duplicate")
        volumes.add(name)
        sources = [k for k in vol if k in VOLUME_SOURCES and vol[k] is not None]
        out.need(len(sources) == 1, "pod.volumes", vf, f"exactly one source, has {sources}")
        if "secret" in sources:
            _secret_volume(out, vol["secret"] or {}, f"{vf}.secret")
        if "hostPath" in sources:
            hp = vol["hostPath"] or {}
            out.need(bool(hp.get("path")), "pod.volumes", f"{vf}.hostPath.path", "required")
            out.need(
                hp.get("type", "") in HOSTPATH_TYPES,
                "pod.volumes",
                f"{vf}.hostPath.type",
                repr(hp.get("type")),
            )
    names: set[str] = set()
    containers = [("initContainers", c) for c in spec.get("initContainers") or []]
    containers += [("containers", c) for c in spec.get("containers") or []]
    out.need(bool(spec.get("containers")), "pod.container-name", f"{field}.containers", "required")
    counters: dict[str, int] = {}
    for kind, c in containers:
        index = counters.get(kind, 0)
        counters[kind] = index + 1
        cf = f"{field}.{kind}[{index}]"
        name = c.get("name")
        out.need(is_dns1123_label(name), "pod.container-name", f"{cf}.name", repr(name))
        out.need(name not in names, "pod.container-name", f"{cf}.name", "duplicate")
        names.add(name)
        _container(out, c, cf, volumes)
    _labels(out, spec.get("nodeSelector"), f"{field}.nodeSelector")
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if required is not None:
        _node_selector_terms(out, required, f"{field}.affinity.nodeAffinity.required")
    _preferred_terms(
        out,
        ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "preferredDuringSchedulingIgnoredDuringExecution"
        ),
        f"{field}.affinity.nodeAffinity.preferred",
    )
    _tolerations(out, spec.get("tolerations"), f"{field}.tolerations")
    sc = spec.get("securityContext") or {}
    for key in ("runAsUser", "runAsGroup"):
        if sc.get(key) is not None:
            out.need(
                0 <= sc[key] <= MAX_INT32,
                "pod.security-context",
                f"{field}.securityContext.{key}",
                "range",
            )
    if sc.get("runAsNonRoot") and sc.get("runAsUser") == 0:
        out.add("pod.security-context", f"{field}.securityContext", "runAsNonRoot with runAsUser 0")
    if spec.get("priorityClassName"):
        out.need(
            is_dns1123_subdomain(spec["priorityClassName"]),
            "pod.priority-class",
            f"{field}.priorityClassName",
            repr(spec["priorityClassName"]),
        )


def _daemonset(out: _Out, obj: Mapping[str, Any]) -> None:
    spec = obj.get("spec") or {}
    template = spec.get("template") or {}
    selector = (spec.get("selector") or {}).get("matchLabels") or {}
    labels = (template.get("metadata") or {}).get("labels") or {}
    out.need(bool(selector), "daemonset.selector", "spec.selector", "required, non-empty")
    out.need(
        all(labels.get(k) == v for k, v in selector.items()),
        "daemonset.selector",
        "spec.template.metadata.labels",
        "`selector` does not match template `labels`",
    )
    _labels(out, labels, "spec.template.metadata.labels")
    restart = (template.get("spec") or {}).get("restartPolicy", "Always")
    out.need(restart == "Always", "daemonset.selector", "spec.template.spec.restartPolicy", restart)
    rolling = (spec.get("updateStrategy") or {}).get("rollingUpdate") or {}
    mu, ms = rolling.get("maxUnavailable"), rolling.get("maxSurge", 0)
    if isinstance(mu, str):
        out.need(
            bool(PERCENT.match(mu)) and int(mu[:-1]) <= 100,
            "daemonset.update",
            "spec.updateStrategy.rollingUpdate.maxUnavailable",
            repr(mu),
        )
    elif mu is not None:
        out.need(isinstance(mu, int) and mu >= 0, "daemonset.update", "maxUnavailable", repr(mu))
    if mu is not None:
        zero = mu in (0, "0%") and ms in (0, "0%", None)
        out.need(not zero, "daemonset.update", "spec.updateStrategy.rollingUpdate", "both zero")
    pod_spec(out, template.get("spec") or {}, "spec.template.spec")


def _job(out: _Out, obj: Mapping[str, Any]) -> None:
    spec = obj.get("spec") or {}
    template = spec.get("template") or {}
    restart = (template.get("spec") or {}).get("restartPolicy")
    out.need(restart in ("OnFailure", "Never"), "job.spec", "spec.template.spec.restartPolicy",
             f"{restart!r}: a Job's pods must be OnFailure or Never")
    for key, low in (("backoffLimit", 0), ("activeDeadlineSeconds", 1),
                     ("ttlSecondsAfterFinished", 0)):
        value = spec.get(key)
        if value is not None:
            out.need(isinstance(value, int) and not isinstance(value, bool) and value >= low,
                     "job.spec", f"spec.{key}", f"{value!r} < {low}")
    _labels(out, (template.get("metadata") or {}).get("labels"), "spec.template.metadata.labels")
    pod_spec(out, template.get("spec") or {}, "spec.template.spec")


def _service(out: _Out, obj: Mapping[str, Any]) -> None:
    spec = obj.get("spec") or {}
    ports = spec.get("ports") or []
    names: set[str] = set()
    for i, port in enumerate(ports):
        pf = f"spec.ports[{i}]"
        out.need(is_port(port.get("port")), "service.ports", f"{pf}.port", "1..65535")
        out.need(
            port.get("protocol", "TCP") in ("TCP", "UDP", "SCTP"), "service.ports", pf, "protocol"
        )
        name = port.get("name")
        if len(ports) > 1:
            out.need(bool(name), "service.ports", f"{pf}.name", "required with several ports")
        if name:
            out.need(is_dns1123_label(name), "service.ports", f"{pf}.name", repr(name))
            out.need(name not in names, "service.ports", f"{pf}.name", "duplicate")
            names.add(name)
    _labels(out, spec.get("selector"), "spec.selector")


def _configmap(out: _Out, obj: Mapping[str, Any]) -> None:
    data = obj.get("data") or {}
    for key in data:
        out.need(
            len(key) <= 253 and bool(CONFIGMAP_KEY.match(key)),
            "configmap.data",
            f"data[{key}]",
            "key",
        )
    size = sum(len(k) + len(v.encode()) for k, v in data.items() if isinstance(v, str))
    out.need(size <= 1 << 20, "configmap.data", "data", f"{size} bytes > 1 MiB")


def _secret_volume(out: _Out, sv: Mapping[str, Any], field: str) -> None:
    out.need(bool(sv.get("secretName")), "pod.secret-volume", f"{field}.secretName", "required")
    modes = [("defaultMode", sv.get("defaultMode"))]
    for i, item in enumerate(sv.get("items") or []):
        key, rel = item.get("key"), item.get("path")
        out.need(isinstance(key, str) and bool(CONFIGMAP_KEY.match(key)), "pod.secret-volume",
                 f"{field}.items[{i}].key", repr(key))
        out.need(isinstance(rel, str) and bool(rel) and not rel.startswith("/")
                 and ".." not in rel.split("/"), "pod.secret-volume",
                 f"{field}.items[{i}].path", repr(rel))
        modes.append((f"items[{i}].mode", item.get("mode")))
    for name, mode in modes:
        if mode is not None:
            out.need(isinstance(mode, int) and not isinstance(mode, bool) and 0 <= mode <= 0o777,
                     "pod.secret-volume", f"{field}.{name}", repr(mode))


def _secret(out: _Out, obj: Mapping[str, Any]) -> None:
    import base64
    import binascii

    size = 0
    for key, value in (obj.get("data") or {}).items():
        out.need(len(key) <= 253 and bool(CONFIGMAP_KEY.match(key)), "secret.data",
                 f"data[{key}]", "key")
        try:
            size += len(base64.b64decode(value, validate=True))
        except (binascii.Error, TypeError, ValueError):
            out.add("secret.data", f"data[{key}]", "not base64")
    out.need(size <= 1 << 20, "secret.data", "data", f"{size} bytes > 1 MiB")
    kind = obj.get("type", "Opaque")
    out.need(is_qualified_name(kind), "secret.data", "type", repr(kind))


def _event(out: _Out, obj: Mapping[str, Any]) -> None:
    if obj.get("eventTime"):
        return
    ns = (obj.get("metadata") or {}).get("namespace", "")
    involved = (obj.get("involvedObject") or {}).get("namespace", "")
    ok = ns == involved if involved else ns in ("", "default")
    out.need(ok, "event.namespace", "involvedObject.namespace", "does not match event.namespace")


def conditions(out: _Out, items: Any, field: str) -> None:
    """metav1.Condition rules (API conventions), for any status that carries conditions."""
    for i, cond in enumerate(items or []):
        cf = f"{field}[{i}]"
        out.need(
            is_qualified_name(cond.get("type")), "condition", f"{cf}.type", repr(cond.get("type"))
        )
        out.need(
            cond.get("status") in ("True", "False", "Unknown"), "condition", f"{cf}.status", "enum"
        )
        out.need(
            bool(cond.get("lastTransitionTime")),
            "condition",
            f"{cf}.lastTransitionTime",
            "must be set",
        )
        reason = cond.get("reason") or ""
        out.need(bool(reason), "condition", f"{cf}.reason", "must be set")
        if reason:
            out.need(
                bool(CONDITION_REASON.match(reason)) and len(reason) <= 1024,
                "condition",
                f"{cf}.reason",
                repr(reason),
            )
        out.need(len(cond.get("message") or "") <= 32768, "condition", f"{cf}.message", "too long")
        if cond.get("observedGeneration") is not None:
            out.need(
                cond["observedGeneration"] >= 0, "condition", f"{cf}.observedGeneration", "< 0"
            )


def pruned_fields(value: Any, schema: Mapping[str, Any], field: str = "") -> Iterator[str]:
    """Paths in `value` the structural schema does not declare (the API server drops them)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, Mapping) and schema.get("type") == "object":
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            path = f"{field}.{key}" if field else key
            if props is not None and key in props:
                yield from pruned_fields(sub, props[key], path)
            elif isinstance(extra, Mapping):
                yield from pruned_fields(sub, extra, path)
            elif extra is not True:
                yield path
    elif isinstance(value, list) and schema.get("type") == "array":
        for i, item in enumerate(value):
            yield from pruned_fields(item, schema.get("items") or {}, f"{field}[{i}]")


_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,),
}


def _value_fits(value: Any, schema: Mapping[str, Any]) -> bool:
    """Whether a value satisfies the scalar constraints of its schema node."""
    kind = schema.get("type")
    if kind in _TYPES:
        if not isinstance(value, _TYPES[kind]):
            return False
        if kind in ("integer", "number") and isinstance(value, bool):
            return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is not None and (value <= low if schema.get("exclusiveMinimum") else value < low):
            return False
        if high is not None and value > high:
            return False
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            return False
        if "pattern" in schema and not re.search(schema["pattern"], value):
            return False
    return True


def default_violations(schema: Mapping[str, Any], field: str = "") -> list[Violation]:
    """Defaults of a structural schema that the API server would refuse (rule crd.defaults)."""
    out = _Out()
    if "default" in schema:
        value = schema["default"]
        out.need(_value_fits(value, schema), "crd.defaults", field or ".",
                 f"default {value!r} does not validate against its own schema")
        out.need(not list(pruned_fields(value, schema)), "crd.defaults", field or ".",
                 f"default {value!r} holds fields the schema prunes")
    for key, sub in (schema.get("properties") or {}).items():
        out.items += default_violations(sub, f"{field}.{key}" if field else key)
    if isinstance(schema.get("items"), Mapping):
        out.items += default_violations(schema["items"], f"{field}[]")
    return out.items


def apply_defaults(value: Any, schema: Mapping[str, Any]) -> Any:
    """What the API server stores for `value`: each default filled where the parent object
    is present (a missing object is not created to hold defaults)."""
    if isinstance(value, Mapping) and schema.get("type") == "object":
        out = dict(value)
        for key, sub in (schema.get("properties") or {}).items():
            if key not in out and "default" in sub:
                out[key] = json.loads(json.dumps(sub["default"]))
            if key in out:
                out[key] = apply_defaults(out[key], sub)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [apply_defaults(item, schema["items"]) for item in value]
    return value


def _weightcache(out: _Out, obj: Mapping[str, Any], schema: Mapping[str, Any] | None) -> None:
    status = obj.get("status") or {}
    conditions(out, status.get("conditions"), "status.conditions")
    if schema is not None:
        props = schema.get("properties") or {}
        for part in ("spec", "status"):
            if obj.get(part) is not None and part in props:
                for path in pruned_fields(obj[part], props[part], part):
                    out.add("crd.pruning", path, "not in the CRD schema: the API server prunes it")


NAMESPACED = {"ConfigMap", "Service", "DaemonSet", "Pod", "Event", "WeightCache", "Secret",
              "Job"}
CHECKS: dict[str, Callable[[_Out, Mapping[str, Any]], None]] = {
    "DaemonSet": _daemonset,
    "Service": _service,
    "ConfigMap": _configmap,
    "Secret": _secret,
    "Event": _event,
    "Job": _job,
    "Pod": lambda out, obj: pod_spec(out, obj.get("spec") or {}, "spec"),
}


def check(
    obj: Mapping[str, Any], *, crd_schema: Mapping[str, Any] | None = None
) -> list[Violation]:
    """The violations of one object (as stored after the write); empty when the server takes it.

    `crd_schema`: the WeightCache openAPIV3Schema, to report fields the server would prune.
    """
    out = _Out()
    kind = obj.get("kind") or ""
    size = len(json.dumps(obj))
    out.need(size <= MAX_OBJECT_BYTES, "object.size", "", f"{size} bytes")
    _metadata(out, obj.get("metadata") or {}, kind, kind in NAMESPACED)
    if kind == "WeightCache":
        _weightcache(out, obj, crd_schema)
    elif kind in CHECKS:
        CHECKS[kind](out, obj)
    return out.items


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: what the server stores after a merge-patch request."""
    if not isinstance(patch, Mapping):
        return patch
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# ---------------------------------------------------------------------------- scheduling


def daemonset_controller_tolerations(host_network: bool) -> list[dict[str, str]]:
    """The tolerations the DaemonSet controller adds to every pod it creates.

    pkg/controller/daemon/util/daemonset_util.go AddOrUpdateDaemonPodTolerations.
    """
    tolerations = [
        {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"},
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"},
        {"key": "node.kubernetes.io/disk-pressure", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/memory-pressure", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/pid-pressure", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"},
    ]
    if host_network:
        tolerations.append(
            {
                "key": "node.kubernetes.io/network-unavailable",
                "operator": "Exists",
                "effect": "NoSchedule",
            }
        )
    return tolerations


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """Toleration.ToleratesTaint (staging/src/k8s.io/api/core/v1/toleration.go)."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    op = toleration.get("operator") or "Equal"
    if op == "Exists":
        return True
    return op == "Equal" and (toleration.get("value") or "") == (taint.get("value") or "")


def schedulable_despite(taints: list[Mapping[str, Any]], pod: Mapping[str, Any]) -> bool:
    """Whether a pod's tolerations cover every NoSchedule/NoExecute taint (TaintToleration)."""
    tolerations = pod.get("tolerations") or []
    return all(
        any(tolerates(t, taint) for t in tolerations)
        for taint in taints
        if taint.get("effect") in ("NoSchedule", "NoExecute")
    )


# ---------------------------------------------------------------------------- Pod Security

BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip


def pod_security_violations(spec: Mapping[str, Any], level: str) -> list[str]:
    """What in a PodSpec the PodSecurity admission plugin refuses at `level` (baseline checks).

    Restates the baseline checks of k8s.io/pod-security-admission/policy this project can
    break: check_hostPathVolumes.go, check_hostNamespaces.go, check_privileged.go,
    check_capabilities_baseline.go, check_hostPorts.go. `privileged` allows everything.
    """
    if level == "privileged":
        return []
    found = []
    for vol in spec.get("volumes") or []:
        if vol.get("hostPath") is not None:
            found.append(f"hostPath volume {vol.get('name')!r}")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            found.append(f"{key}=true")
    for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            found.append(f"container {c.get('name')!r} privileged")
        added = set((sc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if added:
            found.append(f"container {c.get('name')!r} adds {sorted(added)}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                found.append(f"container {c.get('name')!r} hostPort {port['hostPort']}")
    return found
