"""JSON Schema (2020-12) validation of cauto documents, with errors that name the JSON path."""

from __future__ import annotations

import copy
import functools
import json
from importlib import resources

import jsonschema

from cauto.plan.errors import DocumentError

SCHEMA_FILES = {"graph": "graph.schema.json", "plan": "plan.schema.json"}


@functools.cache
def schema_text(kind: str) -> str:
    """Return the text of the shipped JSON Schema file for ``kind`` ("graph" or "plan")."""
    return resources.files("cauto.plan").joinpath("schemas", SCHEMA_FILES[kind]).read_text(encoding="utf-8")


@functools.cache
def load_schema(kind: str) -> dict:
    """Return the JSON Schema of ``kind`` as a dict."""
    return json.loads(schema_text(kind))


def _relax(node: object) -> object:
    """Drop ``additionalProperties: false`` everywhere, so documents from a newer minor still validate."""
    if isinstance(node, dict):
        return {k: _relax(v) for k, v in node.items() if not (k == "additionalProperties" and v is False)}
    if isinstance(node, list):
        return [_relax(v) for v in node]
    return node


@functools.cache
def _validator(kind: str, relaxed: bool) -> jsonschema.protocols.Validator:
    schema = load_schema(kind)
    if relaxed:
        schema = _relax(copy.deepcopy(schema))
    return jsonschema.Draft202012Validator(schema)


def json_path(parts: object) -> str:
    """Render a jsonschema path deque as "$.nodes[3].outputs"."""
    text = "$"
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


def _expected(error: jsonschema.ValidationError) -> str:
    keyword, value = error.validator, error.validator_value
    if keyword == "type":
        return f"type {value}"
    if keyword == "required":
        return f"required fields {value}"
    if keyword in ("enum", "const"):
        return f"one of {value!r}" if keyword == "enum" else f"{value!r}"
    if keyword == "additionalProperties":
        return "only the fields the schema defines"
    if keyword == "pattern":
        return f"a string matching {value}"
    if keyword in ("minimum", "exclusiveMinimum", "minItems", "minLength"):
        return f"{keyword} {value}"
    return f"{keyword}: {value!r}"


def validate(doc: object, kind: str, *, source: str | None = None, relaxed: bool = False) -> None:
    """Raise DocumentError for the most relevant schema violation of ``doc`` as a ``kind`` document.

    ``relaxed`` accepts unknown fields (used for documents of a newer minor version).
    """
    if not isinstance(doc, dict):
        raise DocumentError(f"document is {type(doc).__name__}", expected="a JSON object", source=source)
    error = jsonschema.exceptions.best_match(_validator(kind, relaxed).iter_errors(doc))
    if error is not None:
        raise DocumentError(error.message, path=json_path(error.absolute_path), expected=_expected(error), source=source)
