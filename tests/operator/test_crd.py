"""The committed CRD equals the one generated from the schema source, and it teaches the API."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from weightcache import constants as C
from weightcache.operator import crd, spec
from weightcache.testing import apirules

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
    assert "self.runtime != 'vllm' || has(self.image)" in text


def test_cli_writes_the_file(tmp_path):
    assert crd.main(["--write", str(tmp_path)]) == 0
    assert (tmp_path / crd.CRD_FILENAME).read_text() == crd.render()


def _root_rules() -> list[dict]:
    schema = yaml.safe_load(COMMITTED.read_text())["spec"]["versions"][0]["schema"]
    return schema["openAPIV3Schema"]["x-kubernetes-validations"]


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("llama", True),
        ("a" * 52, True),  # + "-rendezvous" = 63, the Service name limit
        ("a" * 53, False),
        ("a" * 60, False),  # seen on a real API server: 422 for the Service
        ("1llama", False),  # a Service name (DNS-1035 label) cannot start with a digit
        ("my.cache", False),  # a valid object name, but not a valid Service name
        ("llama-", False),
    ],
)
def test_cel_name_rules_admit_only_names_whose_derived_names_are_valid(name, ok):
    """Item 3: the CRD's CEL rules, evaluated by a CEL interpreter, match the apirules verdict.

    The API server evaluates `x-kubernetes-validations` with CEL; cel-python evaluates the same
    expressions here, and the derived names are judged by the Service/object name rules.
    """
    import celpy

    env = celpy.Environment()
    activation = {"self": celpy.json_to_cel({"metadata": {"name": name}, "spec": {}})}
    programs = [env.program(env.compile(rule["rule"])) for rule in _root_rules()]
    verdicts = [bool(program.evaluate(activation)) for program in programs]
    assert all(verdicts) is ok
    derived_ok = apirules.is_dns1123_subdomain(name) and apirules.is_dns1035_label(
        C.rendezvous_service_name(name)
    ) and all(
        apirules.is_dns1123_subdomain(derive(name)) for derive in spec.DERIVED_NAMES
    )
    assert derived_ok is ok
