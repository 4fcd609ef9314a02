"""Profile -> cauto-plan graph document.

Structural fields come from :func:`cauto.profiler.capture.structure_nodes` (so the fingerprint is
the one the runtime computes from its own capture); costs, memory and sharding labels are added.
"""

from __future__ import annotations

from cauto.plan import check_document, graph_fingerprint
from cauto.plan.versioning import CURRENT_VERSION, format_version
from cauto.profiler.capture import structure_nodes, tensor_inputs

try:  # written by another part of cauto-profiler; leave labels out while it is missing
    from cauto.profiler.labels import labels_for
except ImportError:  # pragma: no cover
    labels_for = None


def _symbolic(node) -> bool:
    """True when a node's shapes involve data-dependent sizes (labels need concrete shapes)."""
    from cauto.profiler.capture import output_tensors

    tensors = output_tensors(node) + [t for a in tensor_inputs(node) for t in output_tensors(a)]
    return any(not isinstance(d, int) for t in tensors for d in t.shape) if tensors else False


def downsample_timeline(timeline: list, limit: int, keep: set[int] = frozenset()) -> list:
    """At most about ``limit`` events: evenly spaced ones, every local extreme kept by ``keep``
    (event indices, e.g. the peak), and the first and last."""
    if len(timeline) <= limit:
        return list(timeline)
    stride = len(timeline) / limit
    picked = {int(i * stride) for i in range(limit)} | {0, len(timeline) - 1}
    by_index = {ev[0]: i for i, ev in enumerate(timeline)}
    picked |= {by_index[k] for k in keep if k in by_index}
    return [timeline[i] for i in sorted(picked)]


def build_graph_document(prof, *, max_timeline: int = 2000, validate: bool = True) -> dict:
    """The graph document of ``prof``, a ``cauto.profiler.results.Profile`` (read by its fields, not
    imported: results.py calls this module); validated against the schema unless ``validate`` is False."""
    cap = prof.capture
    nodes = structure_nodes(cap)
    fx_nodes = {n.name: n for n in cap.value_nodes()}
    param_ids = {name for name, (kind, _) in cap.placeholders.items() if kind == "param"}
    for entry in nodes:
        stats = prof.nodes.get(entry["id"])
        if stats is not None:
            entry.update(fwd_flops=stats.fwd_flops, bwd_flops=stats.bwd_flops, fwd_bytes=stats.fwd_bytes,
                         bwd_bytes=stats.bwd_bytes, fwd_time_s=stats.fwd_time_s, bwd_time_s=stats.bwd_time_s,
                         saved_bytes=int(stats.saved_bytes), transient_bytes=int(stats.transient_bytes))
            if stats.bwd_workspace_bytes:
                entry["bwd_workspace_bytes"] = int(stats.bwd_workspace_bytes)
        node = fx_nodes.get(entry["id"])
        if entry["kind"] == "op" and node is not None:
            params = []
            for a in tensor_inputs(node):
                if a.name in param_ids and a.name not in params:
                    params.append(a.name)
            entry["params"] = params
            if labels_for is not None and not _symbolic(node):
                labels = labels_for(node)
                if labels is not None:
                    entry["labels"] = labels
    seen, num_params, param_bytes = set(), 0, 0
    for p in cap.model.parameters():
        key = p.untyped_storage()._cdata
        if key in seen:
            continue
        seen.add(key)
        num_params += p.numel()
        param_bytes += p.numel() * p.element_size()
    keep = {prof.peak_event[0]} if prof.peak_event else set()
    timeline = downsample_timeline(prof.timeline, max_timeline, keep)
    settings = dict(prof.settings)
    settings.pop("steps", None)
    settings["modelled_effects"] = list(prof.modelled_effects)
    doc = {
        "schema_version": format_version(CURRENT_VERSION["graph"]),
        "kind": "graph",
        "fingerprint": graph_fingerprint(nodes),
        "model": {"name": prof.name, "num_params": int(num_params), "param_bytes": int(param_bytes)},
        "settings": settings,
        "device": prof.device_model.to_dict(),
        "nodes": nodes,
        "memory": {"peak_bytes": int(prof.program_peak_bytes), "phases": {k: int(v) for k, v in prof.program_phases.items()},
                   "timeline": [[int(i), ph, node, int(live)] for i, ph, node, live in timeline]},
    }
    if prof.peaks_differ_because is not None:
        doc["memory"]["eager_peak_bytes"] = int(prof.peak_bytes)
        doc["memory"]["peaks_differ_because"] = prof.peaks_differ_because
    if validate:
        check_document(doc, "graph")
    return doc
