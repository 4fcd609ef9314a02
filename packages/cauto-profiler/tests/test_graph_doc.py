"""Profile.to_graph(): a valid cauto-plan graph document whose fingerprint is the capture's."""

from __future__ import annotations

import json

from cauto.plan import check_document, load_graph
from cauto.profiler import capture, profile, zoo


def test_graph_document_validates_and_fingerprint_matches_capture():
    prof = profile(zoo.gpt)
    doc = prof.to_graph()
    check_document(json.loads(json.dumps(doc)), "graph")
    assert doc["fingerprint"] == capture(zoo.gpt).fingerprint()
    assert doc["memory"]["peak_bytes"] == prof.peak_bytes
    assert set(doc["memory"]["phases"]) == {"forward", "backward", "optimizer", "zero_grad"}
    g = load_graph(doc)
    ops = [n for n in g.nodes if n.kind == "op"]
    assert sum(n.fwd_flops + n.bwd_flops for n in ops) == prof.flops
    linear = [n for n in ops if n.op == "aten.linear.default"]
    assert linear and all(n.params and all(p.startswith("p_") for p in n.params) for n in linear)
    assert all(n.fwd_time_s > 0 for n in linear)
    # the tied head uses the embedding's parameter node
    tied = [n for n in g.nodes if n.kind == "param" and n.tied_to]
    assert len(tied) == 1


def test_timeline_is_downsampled_but_keeps_the_peak():
    prof = profile(zoo.llama)
    doc = prof.to_graph(max_timeline=50)
    tl = doc["memory"]["timeline"]
    assert len(tl) <= 52
    assert max(e[3] for e in tl) == prof.peak_bytes


def test_graph_documents_for_hf_models():
    for fn in (zoo.hf_bert,):
        prof = profile(fn, steps=1)
        doc = prof.to_graph()
        assert doc["fingerprint"] == prof.capture.fingerprint()
        assert doc["model"]["num_params"] == sum(p.numel() for p in prof.capture.model.parameters())
