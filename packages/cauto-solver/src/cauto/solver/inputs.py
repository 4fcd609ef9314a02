"""The graph document the solver plans, whichever form it was given in."""

from __future__ import annotations

from collections.abc import Mapping

from cauto.plan import GraphDocument, check_document
from cauto.plan.errors import DocumentError
from cauto.solver.errors import SolverError


def graph_document(graph: GraphDocument | Mapping) -> GraphDocument:
    """``graph`` as a validated GraphDocument: a GraphDocument is taken as it is (made by
    ``cauto.plan.load_graph``, which validated it); a dict is validated here (SolverError if invalid)."""
    if isinstance(graph, GraphDocument):
        return graph
    try:
        return GraphDocument.from_dict(check_document(dict(graph), "graph"))
    except DocumentError as exc:
        raise SolverError(f"invalid graph document: {exc}") from None
