"""Reading and writing cauto documents: parse, check version, validate, cross-check.

Loading never executes code: documents are JSON, parsed with ``json`` and validated against the
shipped schema; anything else is rejected with a DocumentError naming the JSON path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cauto.plan.documents import GraphDocument, PlanDocument, split_ref
from cauto.plan.errors import DocumentError
from cauto.plan.fingerprint import graph_fingerprint
from cauto.plan.schema import validate
from cauto.plan.validate import check_graph, check_plan, check_plan_against_graph
from cauto.plan.versioning import CURRENT_VERSION, KINDS, bring_to_current, parse_version
from cauto.plan.writing import write_atomic

PathLike = str | os.PathLike


def parse(text: str, *, source: str | None = None) -> dict:
    """Parse JSON text into a dict; truncated or malformed JSON raises DocumentError with line/column."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DocumentError(
            f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
            + (" (the file looks truncated)" if exc.pos >= len(text.rstrip()) else ""),
            expected="a complete JSON document", source=source,
        ) from None
    if not isinstance(doc, dict):
        raise DocumentError(f"document is a JSON {type(doc).__name__}", expected="a JSON object", source=source)
    return doc


def check_document(doc: dict, kind: str | None = None, *, source: str | None = None) -> dict:
    """Validate a parsed document and return it at the current version (upgraded if older).

    ``kind`` ("graph" or "plan") is what the caller needs; None accepts either. After the schema, the
    semantic checks of cauto.plan.validate (finite, sane numbers; names, ranks and mesh axes that agree).
    """
    found_kind = doc.get("kind")
    if found_kind not in KINDS:
        raise DocumentError(f"kind is {found_kind!r}", path="$.kind", expected=f"one of {list(KINDS)}", source=source)
    if kind is not None and found_kind != kind:
        raise DocumentError(
            f"this is a {found_kind} document, but a {kind} document is needed here", path="$.kind",
            expected=repr(kind), source=source,
        )
    newer_minor = parse_version(doc.get("schema_version"), source=source)[1] > CURRENT_VERSION[found_kind][1]
    doc = bring_to_current(doc, found_kind, source=source)
    validate(doc, found_kind, source=source, relaxed=newer_minor)
    if found_kind == "graph":
        check_graph_consistency(doc, source=source)
        check_graph(doc, source=source)
    else:
        check_plan(doc, source=source)
    return doc


def check_graph_consistency(doc: dict, *, source: str | None = None) -> None:
    """Check what a schema cannot: unique ids, inputs that name earlier nodes' outputs, the fingerprint."""
    seen: dict[str, int] = {}
    for i, node in enumerate(doc["nodes"]):
        if node["id"] in seen:
            raise DocumentError(f"node id {node['id']!r} appears twice (first at nodes[{seen[node['id']]}])",
                                path=f"$.nodes[{i}].id", expected="unique node ids", source=source)
        for j, ref in enumerate(node["inputs"]):
            src, index = split_ref(ref)
            if src not in seen:
                raise DocumentError(f"input {ref!r} names no earlier node", path=f"$.nodes[{i}].inputs[{j}]",
                                    expected="the id of a node listed before this one", source=source)
            n_out = len(doc["nodes"][seen[src]]["outputs"])
            if index >= n_out:
                raise DocumentError(f"input {ref!r} asks for output {index} of a node with {n_out} outputs",
                                    path=f"$.nodes[{i}].inputs[{j}]", expected=f"an output index < {n_out}",
                                    source=source)
        seen[node["id"]] = i
    actual = graph_fingerprint(doc["nodes"])
    if actual != doc["fingerprint"]:
        raise DocumentError("fingerprint does not match the nodes (the document was edited or corrupted)",
                            path="$.fingerprint", expected=actual, source=source)


def load(path_or_text: PathLike | dict, kind: str | None = None) -> dict:
    """Load a document from a file path (or an already-parsed dict); return the validated dict."""
    if isinstance(path_or_text, dict):
        return check_document(path_or_text, kind)
    path = Path(path_or_text)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DocumentError("file not found", source=source, expected="an existing graph or plan JSON file") from None
    except UnicodeDecodeError:
        raise DocumentError("file is not UTF-8 text", source=source, expected="a JSON document") from None
    return check_document(parse(text, source=source), kind, source=source)


def load_graph(path_or_doc: PathLike | dict) -> GraphDocument:
    """Load and validate a graph document; return it as a GraphDocument."""
    return GraphDocument.from_dict(load(path_or_doc, "graph"))


def load_plan(path_or_doc: PathLike | dict, graph: GraphDocument | dict | None = None) -> PlanDocument:
    """Load and validate a plan document; with ``graph``, also check that it belongs to that graph."""
    plan = PlanDocument.from_dict(load(path_or_doc, "plan"))
    if graph is not None:
        check_plan_matches_graph(plan, graph)
    return plan


def _as_dict(doc: GraphDocument | PlanDocument | dict) -> dict:
    return doc if isinstance(doc, dict) else doc.to_dict()


def check_plan_matches_graph(plan: PlanDocument | dict, graph: GraphDocument | dict) -> None:
    """Raise MismatchError unless ``plan`` was solved for ``graph``, DocumentError unless it names only its
    nodes with placements that fit its tensors (cauto.plan.validate.check_plan_against_graph)."""
    graph_d = _as_dict(graph)
    check_plan_against_graph(_as_dict(plan), graph_d["nodes"], graph_d["fingerprint"])


def dumps(doc: GraphDocument | PlanDocument | dict) -> str:
    """Validate and serialize a document to deterministic JSON text."""
    d = _as_dict(doc)
    check_document(json.loads(json.dumps(d)), d.get("kind"))
    return json.dumps(d, indent=1, sort_keys=False) + "\n"


def dump(doc: GraphDocument | PlanDocument | dict, path: PathLike, *, replace_symlink: bool = False) -> Path:
    """Validate ``doc`` and write it atomically to ``path`` (cauto.plan.writing: no partial file on any
    error, special files refused, a symbolic link replaced only with ``replace_symlink``)."""
    return write_atomic(path, dumps(doc), replace_symlink=replace_symlink)
