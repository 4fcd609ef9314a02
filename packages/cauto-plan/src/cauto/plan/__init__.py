"""cauto.plan: the versioned JSON documents that cauto's packages exchange.

* graph: the profiled forward graph (written by cauto-profiler, read by cauto-solver)
* plan: the parallel plan (written by cauto-solver, read by cauto-runtime)
"""

from cauto.plan.documents import GraphDocument, GraphNode, Labels, PlanDocument, TensorMeta, split_ref
from cauto.plan.errors import DocumentError, MismatchError, OutputError, VersionError
from cauto.plan.fingerprint import graph_fingerprint
from cauto.plan.io import (
    check_document,
    check_plan_matches_graph,
    dump,
    dumps,
    load,
    load_graph,
    load_plan,
    parse,
)
from cauto.plan.placements import format_placement, parse_placement
from cauto.plan.schema import validate
from cauto.plan.versioning import CURRENT_VERSION, NewerMinorVersionWarning
from cauto.plan.writing import check_output, write_atomic

__all__ = [
    "CURRENT_VERSION", "DocumentError", "GraphDocument", "GraphNode", "Labels", "MismatchError",
    "NewerMinorVersionWarning", "OutputError", "PlanDocument", "TensorMeta", "VersionError", "check_document",
    "check_output", "check_plan_matches_graph", "dump", "dumps", "format_placement", "graph_fingerprint", "load",
    "load_graph", "load_plan", "parse", "parse_placement", "split_ref", "validate", "write_atomic",
]
