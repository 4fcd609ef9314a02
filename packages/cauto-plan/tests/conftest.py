"""A tiny valid graph (x @ W -> sum) and a plan for it, built by hand for the schema tests."""

from __future__ import annotations

from cauto.plan import CURRENT_VERSION, graph_fingerprint
from cauto.plan.versioning import format_version


def sample_graph() -> dict:
    nodes = [
        {"id": "p_w", "kind": "param", "op": "param", "module": "lin", "inputs": [], "target": "lin.weight",
         "outputs": [{"shape": [8, 4], "dtype": "float32", "bytes": 128}], "requires_grad": True},
        {"id": "x", "kind": "input", "op": "input", "module": "", "inputs": [],
         "outputs": [{"shape": [16, 4], "dtype": "float32", "bytes": 256}]},
        {"id": "linear", "kind": "op", "op": "aten.linear.default", "module": "lin", "inputs": ["x", "p_w"],
         "outputs": [{"shape": [16, 8], "dtype": "float32", "bytes": 512}], "fwd_flops": 1024.0,
         "bwd_flops": 2048.0, "saved_bytes": 0, "params": ["p_w"],
         "labels": {"inputs": ["bk", "nk"], "outputs": ["bn"], "reduce": "sum", "rule": "matmul"}},
        {"id": "sum", "kind": "op", "op": "aten.sum.default", "module": "", "inputs": ["linear"],
         "outputs": [{"shape": [], "dtype": "float32", "bytes": 4}],
         "labels": {"inputs": ["bn"], "outputs": [""], "reduce": "sum", "rule": "reduction"}},
    ]
    return {
        "schema_version": format_version(CURRENT_VERSION["graph"]), "kind": "graph", "fingerprint": graph_fingerprint(nodes),
        "model": {"name": "tiny", "num_params": 32, "param_bytes": 128},
        "settings": {"train": True, "optimizer": "adamw", "dtype": "float32", "device": "cpu"},
        "device": {"name": "cpu", "peak_flops": 1e11, "memory_bandwidth_bytes_per_s": 1e10, "kernel_floor_s": 5e-6},
        "nodes": nodes,
        "memory": {"peak_bytes": 2048, "phases": {"forward": 1024, "backward": 2048}},
    }


def sample_plan(graph: dict) -> dict:
    return {
        "schema_version": format_version(CURRENT_VERSION["plan"]), "kind": "plan", "graph_fingerprint": graph["fingerprint"],
        "mesh": {"shape": [2], "axis_names": ["dp"]},
        "cluster": {"name": "test", "axes": [{"latency_s": 1e-5, "bandwidth_bytes_per_s": 1e9}],
                    "device": {"memory_bytes": 1 << 30, "peak_flops": 1e11, "memory_bandwidth_bytes_per_s": 1e10}},
        "nodes": {
            "x": {"inputs": [], "outputs": [["S(0)"]]},
            "p_w": {"inputs": [], "outputs": [["R"]]},
            "linear": {"name": "b@dp", "inputs": [["S(0)"], ["R"]], "outputs": [["S(0)"]]},
            "sum": {"inputs": [["S(0)"]], "outputs": [["P(sum)"]]},
        },
        "params": {"p_w": {"target": "lin.weight", "placements": ["R"], "state": "device"}},
        "edges": [],
        "grad_sync": [{"op": "all_reduce", "axis": 0, "bytes": 128, "phase": "grad_sync", "where": "p_w"}],
        "execution": {"mode": "program", "grad_reductions": []},
        "predictions": {"peak_bytes": 1024, "step_time_s": {"total": 1e-4, "compute": 8e-5, "communication": 2e-5},
                        "collectives": [{"op": "all_reduce", "axis": 0, "bytes": 128, "phase": "grad_sync"}]},
        "solver": {"name": "cbc", "status": "optimal", "objective_s": 1e-4, "gap": 0.0, "time_s": 0.01},
    }


import pytest  # noqa: E402


@pytest.fixture
def graph() -> dict:
    return sample_graph()


@pytest.fixture
def plan(graph) -> dict:
    return sample_plan(graph)
