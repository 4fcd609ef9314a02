"""Chunked model state in a training-state checkpoint, under the keys a device-only plan uses.

``chunked_state(optimizer, module, shards)`` is this rank's part of the checkpoint as
``torch.distributed.checkpoint`` takes it, in the layout of torch's ``get_state_dict``::

    {"model": {fqn: parameter or buffer},
     "optim": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [{..., "params": [fqn]}]}}

A rank lists only the parameters of the chunks it owns (ZeRO: each chunk's fp32 master or
parameters and Adam moments live on one rank of the data-parallel group), as views of the chunks'
host buffers, so saving copies nothing and each rank writes only its own shards. A parameter that
is itself a shard of a tensor-parallel DTensor (chunks beside tensor parallelism) is listed as that
DTensor (its global shape and placements), so DCP records where the shard sits. Because the keys,
shapes and values are those of a device-only plan, one checkpoint loads into any plan of the same
model: chunked or not, on any mesh (DCP reads each rank's pieces from whichever shards hold them).

Loading goes into the same views; ``ChunkedState.finish()`` then pushes what was read into the
chunks' device copies, refreshes the compute-dtype parameters from the fp32 master, drops every
gathered copy of other ranks' chunks (the next forward gathers the loaded values) and restores the
step counts and hyperparameters (a learning rate a scheduler changed is part of the state).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .manager import EXP_AVG, EXP_AVG_SQ, MASTER, PARAM
from .optim import ChunkedAdam


@dataclass
class ChunkedState:
    """This rank's checkpoint dictionary (``state``) and what ``finish`` needs after a load."""

    state: dict
    optimizer: ChunkedAdam
    steps: dict[str, torch.Tensor] = field(default_factory=dict)
    owned: list[int] = field(default_factory=list)

    def finish(self) -> None:
        """After ``dcp.load`` into ``state``: make the chunks, steps and groups what was read (module docstring)."""
        opt = self.optimizer
        mgr = opt.manager
        kinds = [EXP_AVG, EXP_AVG_SQ] + ([MASTER] if mgr.has_master else [PARAM])
        for i in self.owned:
            if mgr.has_master:  # the compute-dtype parameters from the fp32 master that was read
                mgr.host_view(mgr.chunks[(PARAM, i)]).copy_(mgr.host_view(mgr.chunks[(MASTER, i)]))
            for kind in kinds + ([PARAM] if mgr.has_master else []):
                mgr.host_written(mgr.chunks[(kind, i)])
        for i in range(mgr.layout.num_chunks):  # gathered copies of other ranks' chunks are stale now
            c = mgr.chunks[(PARAM, i)]
            if not mgr.owned(i) and c.present and not c.pins:
                mgr.discard(c)
        for name, t in self.steps.items():
            opt.steps[name] = int(round(float(t)))
        for group, saved in zip(opt.param_groups, self.state["optim"]["param_groups"]):
            group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items() if k != "params"})
        opt.model.new_iteration = True


def _aliases(module: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def chunked_state(optimizer: ChunkedAdam, module: nn.Module, shards: dict | None = None) -> ChunkedState:
    """This rank's checkpoint dictionary of a model whose parameters are all in ``optimizer``'s chunks
    (module docstring). ``module`` is the user's model (its names and buffers); ``shards`` maps the
    names of tensor-parallel parameters to their ``ChunkedShard`` (None: plain parameters)."""
    mgr = optimizer.manager
    layout = mgr.layout
    weights = MASTER if mgr.has_master else PARAM
    aliases = _aliases(module)
    in_chunks = {id(slot.param) for slot in layout.slots}
    model_sd = {name: t for name, t in module.state_dict(keep_vars=True).items()
                if id(t) not in in_chunks}  # buffers and frozen parameters, as the model holds them
    optim_state: dict[str, dict] = {}
    out = ChunkedState({}, optimizer)

    def entry(kind: str, i: int, slot) -> torch.Tensor:
        view = mgr.host_view(mgr.chunks[(kind, i)])[slot.offset: slot.offset + slot.numel].view(slot.shape)
        shard = (shards or {}).get(slot.name)
        if shard is None:
            return view
        return DTensor.from_local(view, shard.mesh, shard.placements, run_check=False, shape=shard.shape,
                                  stride=shard.stride)

    for i in range(layout.num_chunks):
        if not mgr.owned(i) or layout.chunk_group[i] < 0:
            continue
        out.owned.append(i)
        for slot in layout.chunk_slots[i]:
            weight = entry(weights, i, slot)
            for name in aliases.get(id(slot.param), [slot.name]):
                model_sd[name] = weight
            step = torch.tensor(float(optimizer.steps[slot.name]))
            out.steps[slot.name] = step
            optim_state[slot.name] = {"step": step, "exp_avg": entry(EXP_AVG, i, slot),
                                      "exp_avg_sq": entry(EXP_AVG_SQ, i, slot)}
    members: list[list[str]] = [[] for _ in optimizer.param_groups]
    for slot in layout.slots:
        members[slot.group].append(slot.name)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": names}
              for g, names in zip(optimizer.param_groups, members)]
    out.state = {"model": model_sd, "optim": {"state": optim_state, "param_groups": groups}}
    return out
