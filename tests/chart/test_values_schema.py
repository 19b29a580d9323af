"""values.schema.json accepts the shipped and example values and rejects bad ones, both
through helm itself and as a plain JSON Schema."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml

from tests.chart import chart
from tests.chart.conftest import VALUE_SETS

SCHEMA = json.loads((chart.CHART / "values.schema.json").read_text())
DEFAULTS = yaml.safe_load((chart.CHART / "values.yaml").read_text())


def _merge(base, override):
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = _merge(base.get(key), value) if key in base else value
        return out
    return override


def test_schema_is_a_valid_draft7_schema():
    jsonschema.Draft7Validator.check_schema(SCHEMA)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_shipped_value_sets_are_accepted(name):
    values = DEFAULTS
    for item in VALUE_SETS[name][0]:
        values = _merge(values, yaml.safe_load((chart.VALUES / item).read_text()))
    jsonschema.Draft7Validator(SCHEMA).validate(values)


BAD = [
    ("webhook.failurePolicy=Sometimes", "failurePolicy"),
    ("webhook.timeoutSeconds=60", "timeoutSeconds"),
    ("webhook.certificates.mode=vault", "mode"),
    ("operator.replicas=0", "replicas"),
    ("operator.logFormat=xml", "logFormat"),
    ("operator.ports.metrics=70000", "metrics"),
    ("agent.ports.grpc=0", "grpc"),
    ("operator.image.digest=latest", "digest"),
    ("operator.watchNamespaces[0]=Not_A_Namespace", "watchNamespaces"),
    ("operator.extraArgs[0]=positional", "extraArgs"),
    ("operator.imagePullPolicy=Always", "imagePullPolicy"),  # misplaced key
    ("metrics.serviceMonitor.interval=often", "interval"),
    ("caches[0].name=x", "spec"),
    ("caches[0].name=x,caches[0].spec.runtime=sglang,caches[0].spec.model.path=/m", "runtime"),
    # Two reconcilers at once: more than one replica needs peering.
    ("operator.replicas=2,operator.leaderElection.enabled=false", "allOf"),
]


@pytest.mark.parametrize(("setting", "mentions"), BAD, ids=[b[0] for b in BAD])
def test_helm_refuses_bad_values(setting, mentions):
    proc = chart.helm("template", "x", str(chart.CHART), "--set", setting, check=False)
    assert proc.returncode != 0, f"helm accepted {setting}"
    assert "schema" in proc.stderr and mentions in proc.stderr, proc.stderr


def test_unknown_top_level_key_is_refused():
    proc = chart.helm("template", "x", str(chart.CHART), "--set", "replicaCount=3", check=False)
    assert proc.returncode != 0 and "replicaCount" in proc.stderr
