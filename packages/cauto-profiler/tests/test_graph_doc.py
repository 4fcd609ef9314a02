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


def test_a_tensor_with_several_names_ties_each_to_the_name_the_graph_reads():
    """T5 holds one embedding under four names (shared, encoder and decoder embed_tokens, lm_head): every
    other name is tied to the one placeholder the graph reads, never to another unread name (before: a
    chain, and the solver gave the unread links placements of their own, which the runtime stored)."""
    import torch
    from torch import nn

    class FourNames(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = nn.Embedding(16, 8)
            self.enc = nn.Module()
            self.dec = nn.Module()
            self.enc.embed = self.dec.embed = self.shared
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.shared.weight

        def forward(self, ids):
            return self.head(self.dec.embed(ids)).sum()

    cap = capture(lambda: (FourNames(), torch.randint(0, 16, (2, 4))))
    read = {n.name for n in cap.graph.nodes if n.op == "placeholder" and n.users}
    assert len(cap.tied) == 3 and set(cap.tied.values()) <= read and len(set(cap.tied.values())) == 1
