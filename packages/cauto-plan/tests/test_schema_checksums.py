"""A schema file may only change together with the version bump its change needs."""

import hashlib
import json
from pathlib import Path

import pytest

from cauto.plan.schema import schema_text
from cauto.plan.schema_bump import needed_bump
from cauto.plan.versioning import CURRENT_VERSION, format_version

HERE = Path(__file__).parent
RECORDED = json.loads((HERE / "schema_checksums.json").read_text())


@pytest.mark.parametrize("kind", ["graph", "plan"])
def test_schema_checksum_matches_its_version(kind):
    version = format_version(CURRENT_VERSION[kind])
    actual = hashlib.sha256(schema_text(kind).encode()).hexdigest()
    recorded = RECORDED[kind]
    latest_released = max(recorded, key=lambda v: tuple(map(int, v.split("."))))
    if version in recorded:
        if recorded[version] != actual:
            old = json.loads((HERE / "released" / f"{kind}-{latest_released}.schema.json").read_text())
            bump, reasons = needed_bump(old, json.loads(schema_text(kind)))
            pytest.fail(f"{kind} schema {version} changed without a version bump; it needs a {bump} bump: "
                        + "; ".join(reasons[:5]))
    else:
        pytest.fail(f"{kind} schema version {version} is not recorded: add its checksum to schema_checksums.json "
                    f"and copy the schema to tests/released/{kind}-{version}.schema.json")


def test_bump_rules():
    old = {"type": "object", "required": ["a"], "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    added_optional = {**old, "properties": {**old["properties"], "c": {"type": "string"}}}
    assert needed_bump(old, added_optional)[0] == "minor"
    newly_required = {**old, "required": ["a", "b"]}
    assert needed_bump(old, newly_required)[0] == "major"
    removed = {**old, "properties": {"a": {"type": "string"}}}
    assert needed_bump(old, removed)[0] == "major"
    assert needed_bump(old, old)[0] == "none"


@pytest.mark.parametrize("kind", ["graph", "plan"])
def test_released_copies_match_their_checksums(kind):
    for version, digest in RECORDED[kind].items():
        text = (HERE / "released" / f"{kind}-{version}.schema.json").read_text()
        assert hashlib.sha256(text.encode()).hexdigest() == digest


def test_plan_1_1_is_a_minor_bump_of_1_0():
    old = json.loads((HERE / "released" / "plan-1.0.schema.json").read_text())
    new = json.loads((HERE / "released" / "plan-1.1.schema.json").read_text())
    bump, reasons = needed_bump(old, new)
    assert bump == "minor", reasons
