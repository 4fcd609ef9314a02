"""Which redistributions inside checkpoint regions backward runs again (checkpoint/recompute.py)."""

from cauto.solver.checkpoint.recompute import recompute_collectives, recomputed_inputs


def _graph() -> dict:
    def op(i, name, inputs):
        return {"id": i, "kind": "op", "op": f"aten.{name}.default", "inputs": inputs, "outputs": []}
    return {"nodes": [
        {"id": "x", "kind": "input", "requires_grad": True, "outputs": []},
        {"id": "w", "kind": "param", "outputs": []},
        op("lin", "linear", ["x", "w"]), op("add", "add", ["x", "lin"]), op("ln", "layer_norm", ["add"])]}


def _plan(edges) -> dict:
    return {"edges": [{"dst": d, "arg": a, "collectives": [{"op": "all_gather", "where": f"{d}:{a}"}]}
                      for d, a in edges]}


def test_a_gather_only_an_add_reads_is_not_run_again_when_the_next_reader_saves_its_own_copy():
    regions = [{"nodes": ["lin", "add"], "children": []}]
    plan = _plan([("lin", 0), ("add", 1), ("ln", 0)])  # ln takes add's output through a redistribution
    assert recomputed_inputs(_graph(), regions, {("lin", 0), ("add", 1), ("ln", 0)}) == {("lin", 0), ("lin", 1)}
    assert [c["where"] for c in recompute_collectives(plan, regions, _graph())] == ["recompute: lin:0"]


def test_a_region_output_read_directly_outside_is_saved_not_recomputed():
    regions = [{"nodes": ["lin", "add"], "children": []}]
    plan = _plan([("lin", 0), ("add", 1)])  # ln reads add's output itself: saved, as checkpoint keeps outputs
    assert sorted(c["where"] for c in recompute_collectives(plan, regions, _graph())) == ["recompute: lin:0"]


def test_nested_regions_rerun_whole_regions_once_per_level():
    regions = [{"nodes": ["lin", "add"], "children": [1]}, {"nodes": ["add"], "children": []}]
    plan = _plan([("lin", 0), ("add", 1), ("ln", 0)])
    assert sorted(c["where"] for c in recompute_collectives(plan, regions, _graph())) == \
        ["recompute: add:1", "recompute: add:1", "recompute: lin:0"]
