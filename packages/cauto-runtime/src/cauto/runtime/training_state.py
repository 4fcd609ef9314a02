"""Training-state checkpoints of a ParallelModule: save, find the latest complete one, load.

``save(model, D, step)`` writes ``D/step-00000012/``: the parameters and optimizer state through
``torch.distributed.checkpoint`` (``get_state_dict``: DTensors under the model's own names, each
rank writing only its shards), each rank's RNG state (``rng-rank<R>.pt``), and last a marker
``COMPLETE.json`` (step, graph fingerprint, mesh, world size). It writes into
``D/.step-00000012.partial/`` and rank 0 renames that folder only after every rank has written
and the marker is in place, so a checkpoint is complete or absent: a crash mid-save leaves a
``.partial`` folder that ``latest`` ignores, and the previous checkpoint stays usable.

``load(model, D)`` takes ``D``'s latest complete checkpoint (or ``D`` itself when it is one),
refuses one whose graph fingerprint is not the model's (CheckpointError says both), loads the
state in place and returns the step it was saved at. DCP reshards on load, so the same files load
on another mesh; the RNG states are restored only on the world size they were saved on.

Plans with chunked state (the chunk manager's ZeRO-sharded fp32 weights and Adam moments, on the
device or the host) write the same keys, shapes and values, each rank only the parameters of the
chunks it owns (chunks/checkpoint.py). So a checkpoint loads into any plan of the same model,
chunked or not, on any mesh.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from cauto.plan import write_atomic
from cauto.runtime.chunks.checkpoint import ChunkedState, chunked_state

MARKER = "COMPLETE.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(ValueError):
    """No usable checkpoint, or one of another model; the message says which and what to do."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _state(model, optimizer) -> tuple[dict, ChunkedState | None]:
    """This rank's checkpoint dictionary, and for chunked state what to do after loading into it."""
    chunked = getattr(model, "chunked", None)
    if chunked is not None:
        if optimizer is None:
            raise CheckpointError("a plan with chunked state saves and loads with its optimizer (the chunk "
                                  "manager's ChunkedAdam holds the fp32 weights): pass model.optimizer")
        shards = getattr(model, "chunk_shards", None) or None  # chunks beside tensor parallelism: DTensor shards
        held = chunked_state(optimizer, model if shards else chunked.module, shards)
        return held.state, held
    if optimizer is None:
        return {"model": get_state_dict(model, [])[0]}, None
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}, None


def _keep_saved(state: dict, saved: set[str], prefix: str = "") -> list[str]:
    """Drop from ``state`` (in place) every value the checkpoint does not hold, with DCP's flattened names
    (``optim.param_groups.0.lr``): optimizer hyperparameters that another plan's optimizer does not
    record keep this run's values. Return the names of the tensors it lacks (a real mismatch)."""
    missing = []
    items = state.items() if isinstance(state, dict) else enumerate(state)
    for key, value in list(items):
        name = f"{prefix}{key}"
        if isinstance(value, dict) or (isinstance(value, list) and any(isinstance(v, dict) for v in value)):
            missing += _keep_saved(value, saved, name + ".")
        elif name not in saved:
            if isinstance(value, torch.Tensor):
                missing.append(name)
            elif isinstance(state, dict):
                del state[key]
    return missing


def save(model, directory: str | os.PathLike, step: int, optimizer=None) -> Path:
    """Save ``model`` (and ``optimizer``) at training ``step`` under ``directory`` (module docstring);
    every rank calls it. Return the checkpoint's folder."""
    directory = Path(directory)
    final = directory / f"step-{step:08d}"
    partial = directory / f".step-{step:08d}.partial"
    rank = _rank()
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()
    dcp.save(_state(model, optimizer)[0], checkpoint_id=str(partial))
    torch.save({"cpu": torch.get_rng_state()}, partial / f"rng-rank{rank}.pt")
    _barrier()
    if rank == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        write_atomic(partial / MARKER, json.dumps({
            "step": step, "graph_fingerprint": model.plan.graph_fingerprint, "mesh": model.plan.mesh,
            "world_size": world, "optimizer": optimizer is not None}, indent=1) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
    _barrier()
    return final


def latest(directory: str | os.PathLike) -> Path | None:
    """The folder of the latest complete checkpoint in ``directory`` (``directory`` itself when it is
    one), or None."""
    directory = Path(directory)
    if (directory / MARKER).is_file():
        return directory
    steps = []
    for child in directory.iterdir() if directory.is_dir() else ():
        match = _STEP_DIR.match(child.name)
        if match and (child / MARKER).is_file():
            steps.append((int(match.group(1)), child))
    return max(steps)[1] if steps else None


def check_resumable(directory: str | os.PathLike, graph_fingerprint: str) -> tuple[Path, dict]:
    """(folder, marker) of the checkpoint to resume from in ``directory``; CheckpointError when there is
    none or it belongs to another model."""
    found = latest(directory)
    if found is None:
        raise CheckpointError(f"no complete checkpoint in {directory} (a folder step-N with {MARKER}); "
                              "train with --save-every N --save-dir DIR first, or drop --resume")
    marker = json.loads((found / MARKER).read_text())
    if marker["graph_fingerprint"] != graph_fingerprint:
        raise CheckpointError(f"checkpoint {found} is of graph {marker['graph_fingerprint'][:12]}, but this model is "
                              f"{graph_fingerprint[:12]}: it was saved by another model (or other sizes); resume with "
                              "the model and plan it was trained with")
    return found, marker


def load(model, directory: str | os.PathLike, optimizer=None) -> int:
    """Load the latest complete checkpoint of ``directory`` into ``model`` (and ``optimizer``) in place;
    return its step. Every rank calls it."""
    found, marker = check_resumable(directory, model.plan.graph_fingerprint)
    if optimizer is not None and not marker.get("optimizer"):
        raise CheckpointError(f"checkpoint {found} holds no optimizer state; load it without an optimizer")
    state, chunked = _state(model, optimizer)
    saved = set(dcp.FileSystemReader(str(found)).read_metadata().state_dict_metadata)
    missing = _keep_saved(state, saved)
    if missing:
        raise CheckpointError(f"checkpoint {found} lacks {len(missing)} of this model's tensors (first: {missing[0]}); "
                              "it was saved with another optimizer, or without parameters this model has")
    try:
        dcp.load(state, checkpoint_id=str(found))
    except BaseException as exc:  # DCP's CheckpointException is a BaseException carrying each rank's failure
        failures = getattr(exc, "failures", None)
        if not failures:
            raise
        first = next(iter(failures.values()))
        raise CheckpointError(f"checkpoint {found} could not be loaded into this plan: {type(first).__name__}: "
                              f"{str(first).strip().splitlines()[0] if str(first).strip() else ''}") from None
    if chunked is not None:
        chunked.finish()
    elif optimizer is None:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    world = dist.get_world_size() if dist.is_initialized() else 1
    rng = found / f"rng-rank{_rank()}.pt"
    if marker["world_size"] == world and rng.is_file():
        torch.set_rng_state(torch.load(rng, weights_only=True)["cpu"])
    return int(marker["step"])
