"""The committed CRD equals the one generated from the schema source, and it teaches the API."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from weightcache.operator import crd

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "crds" / crd.CRD_FILENAME


def test_committed_crd_matches_schema_source():
    assert COMMITTED.read_text() == crd.render(), (
        "crds/ drifted from operator/crd.py: run `make crds` (weightcache crds --write crds/)"
    )


def test_crd_is_a_valid_customresourcedefinition():
    kubernetes_validate.validate(yaml.safe_load(COMMITTED.read_text()), "1.30", strict=True)


def _walk(schema: dict, path: str):
    yield path, schema
    for name, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")


def test_every_field_has_a_description():
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    missing = [
        path
        for path, sub in _walk(schema, "")
        if path not in (".metadata",) and not path.endswith("[]") and not sub.get("description")
    ]
    assert missing == []


def _validator() -> jsonschema.Validator:
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return jsonschema.Draft4Validator(schema)


@pytest.mark.parametrize(
    ("spec", "ok"),
    [
        ({"runtime": "native", "model": {"path": "/models/m"}}, True),
        ({"runtime": "other", "model": {"path": "/models/m"}}, False),
        ({"runtime": "native"}, False),
        ({"runtime": "native", "model": {"path": "/m"}, "parallelism": {"tensor": 0}}, False),
        ({"runtime": "native", "model": {"path": "/m"}, "parallelism": {"pipeline": 2}}, False),
        ({"runtime": "native", "model": {"path": "/m"}, "ports": {"health": 70000}}, False),
        ({"runtime": "native", "model": {"path": "/m"}, "engine": {"mode": "fast"}}, False),
    ],
)
def test_openapi_schema_accepts_and_rejects(spec, ok):
    errors = list(_validator().iter_errors({"spec": spec}))
    assert (errors == []) is ok, errors


def test_cel_rules_present():
    text = COMMITTED.read_text()
    assert "!has(self.pipeline) || self.pipeline == 1" in text
    assert "size(self.metadata.name) <= 63" in text
    assert "self.runtime != 'vllm' || has(self.image)" in text


def test_cli_writes_the_file(tmp_path):
    assert crd.main(["--write", str(tmp_path)]) == 0
    assert (tmp_path / crd.CRD_FILENAME).read_text() == crd.render()
