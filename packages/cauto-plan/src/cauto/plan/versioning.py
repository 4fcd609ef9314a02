"""Schema versions of cauto documents and the rules for reading other versions.

Every document carries ``schema_version: "MAJOR.MINOR"``, independent of package versions.
* Same major, older minor: upgraded on read by the registered upgraders (in order).
* Same major, newer minor: read with a warning (unknown optional fields may be lost).
* Any other major: ``VersionError`` naming both versions.
A new optional field is a minor bump; a removed, renamed or newly required field is a major bump.
``tests/test_schema_checksums.py`` fails when a schema file changes without the matching bump.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from cauto.plan.errors import DocumentError, VersionError
from cauto.plan.execution import add_execution

KINDS = ("graph", "plan")

#: The version this cauto-plan writes, per document kind.
CURRENT_VERSION: dict[str, tuple[int, int]] = {"graph": (1, 2), "plan": (1, 4)}


def _graph_1_0_to_1_1(doc: dict) -> dict:
    """Graph 1.1 adds the optional ``bwd_workspace_bytes`` of a node; a 1.0 document measured none and is a
    valid 1.1 document as it is."""
    return doc


def _graph_1_1_to_1_2(doc: dict) -> dict:
    """Graph 1.2 adds the optional ``memory.eager_peak_bytes`` and ``memory.peaks_differ_because``; a 1.1
    document knew one peak, and is a valid 1.2 document as it is."""
    return doc


def _plan_1_0_to_1_1(doc: dict) -> dict:
    """Plan 1.1 adds optional fields only (``offload``, ``cluster.device.host_link_bandwidth_bytes_per_s``):
    a 1.0 document is a valid 1.1 document as it is."""
    return doc


def _plan_1_1_to_1_2(doc: dict) -> dict:
    """Plan 1.2 adds ``execution`` and ``offload.simulated_device_budget_bytes``, which the runtime reads
    instead of deriving them: an older document gets them by the rules of ``cauto.plan.execution``."""
    return add_execution(doc)


def _plan_1_2_to_1_3(doc: dict) -> dict:
    """Plan 1.3 adds the optional ``execution.mixed_precision``; without it a plan trains in its parameters'
    dtype, as every older plan did: a 1.2 document is a valid 1.3 document as it is."""
    return doc


def _plan_1_3_to_1_4(doc: dict) -> dict:
    """Plan 1.4 adds the optional ``execution.regather_params``; without it every gathered parameter copy is
    kept for backward, as every older plan did: a 1.3 document is a valid 1.4 document as it is."""
    return doc


#: (kind, from_minor) -> function that turns a document of MAJOR.from_minor into MAJOR.from_minor+1.
UPGRADERS: dict[tuple[str, int], Callable[[dict], dict]] = {("graph", 0): _graph_1_0_to_1_1,
                                                           ("graph", 1): _graph_1_1_to_1_2,
                                                           ("plan", 0): _plan_1_0_to_1_1,
                                                           ("plan", 1): _plan_1_1_to_1_2,
                                                           ("plan", 2): _plan_1_2_to_1_3,
                                                           ("plan", 3): _plan_1_3_to_1_4}


class NewerMinorVersionWarning(UserWarning):
    """The document was written by a newer cauto-plan of the same major version."""


def format_version(version: tuple[int, int]) -> str:
    """Return the "MAJOR.MINOR" string of a version tuple."""
    return f"{version[0]}.{version[1]}"


def parse_version(text: object, *, source: str | None = None) -> tuple[int, int]:
    """Parse a "MAJOR.MINOR" string; raise DocumentError naming $.schema_version otherwise."""
    if not isinstance(text, str):
        raise DocumentError(
            f"schema_version is {type(text).__name__}", path="$.schema_version",
            expected='a string "MAJOR.MINOR"', source=source,
        )
    parts = text.split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise DocumentError(
            f"schema_version {text!r} is not MAJOR.MINOR", path="$.schema_version",
            expected='a string like "1.0"', source=source,
        )
    return int(parts[0]), int(parts[1])


def bring_to_current(doc: dict, kind: str, *, source: str | None = None) -> dict:
    """Return ``doc`` at this package's version of ``kind``: upgraded, warned about, or refused."""
    current = CURRENT_VERSION[kind]
    found = parse_version(doc.get("schema_version"), source=source)
    if found[0] != current[0]:
        raise VersionError(
            f"{kind} document has schema version {format_version(found)}, but this cauto-plan reads "
            f"major version {current[0]} (writes {format_version(current)}); "
            "re-create the document with a matching cauto version or upgrade cauto-plan",
            path="$.schema_version", expected=f"{current[0]}.x", source=source,
        )
    if found[1] > current[1]:
        warnings.warn(
            f"{source or kind + ' document'} has schema version {format_version(found)}, newer than "
            f"{format_version(current)}; fields this version does not know are ignored",
            NewerMinorVersionWarning, stacklevel=3,
        )
        return doc
    minor = found[1]
    while minor < current[1]:
        doc = UPGRADERS[(kind, minor)](doc)
        minor += 1
        doc["schema_version"] = format_version((current[0], minor))
    return doc
