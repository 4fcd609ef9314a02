"""Tell which version bump a schema change needs (used by the checksum test and by developers).

Removing a property, adding a required field, or narrowing a type/enum breaks old readers or old
documents: major. Adding an optional property or widening an enum: minor.
"""

from __future__ import annotations


def _walk(schema: object, path: str, out: dict[str, dict]) -> None:
    if isinstance(schema, dict):
        entry = out.setdefault(path, {"properties": set(), "required": set(), "enum": None, "type": None})
        entry["properties"] |= set(schema.get("properties", {}))
        entry["required"] |= set(schema.get("required", []))
        if "enum" in schema:
            entry["enum"] = {repr(v) for v in schema["enum"]}
        if "type" in schema:
            t = schema["type"]
            entry["type"] = set(t) if isinstance(t, list) else {t}
        for key, value in schema.items():
            if key in ("properties", "$defs"):
                for name, sub in value.items():
                    _walk(sub, f"{path}/{key}/{name}", out)
            elif isinstance(value, (dict, list)) and key not in ("enum", "required", "const"):
                _walk(value, f"{path}/{key}", out)
    elif isinstance(schema, list):
        for i, sub in enumerate(schema):
            _walk(sub, f"{path}/{i}", out)


def needed_bump(old: dict, new: dict) -> tuple[str, list[str]]:
    """Return ("none" | "minor" | "major", reasons) for a change from schema ``old`` to ``new``."""
    before, after = {}, {}
    _walk(old, "#", before)
    _walk(new, "#", after)
    major, minor = [], []
    for path, b in before.items():
        a = after.get(path)
        if a is None:
            major.append(f"{path} removed")
            continue
        if b["properties"] - a["properties"]:
            major.append(f"{path}: properties removed {sorted(b['properties'] - a['properties'])}")
        if a["required"] - b["required"]:
            major.append(f"{path}: newly required {sorted(a['required'] - b['required'])}")
        if b["enum"] is not None and a["enum"] is not None and b["enum"] - a["enum"]:
            major.append(f"{path}: enum values removed {sorted(b['enum'] - a['enum'])}")
        if b["type"] is not None and a["type"] is not None and b["type"] - a["type"]:
            major.append(f"{path}: types removed {sorted(b['type'] - a['type'])}")
        if a["properties"] - b["properties"]:
            minor.append(f"{path}: properties added {sorted(a['properties'] - b['properties'])}")
        if b["enum"] is not None and a["enum"] is not None and a["enum"] - b["enum"]:
            minor.append(f"{path}: enum values added")
    for path in after.keys() - before.keys():
        minor.append(f"{path} added")
    if major:
        return "major", major
    if minor or old != new:
        return "minor", minor or ["descriptions or constraints changed"]
    return "none", []
