"""One rank of the runtime's multi-process tests: ``python workers.py RANK WORLD PORT JOBS.json OUT.json``.

Each job applies a plan to a zoo model on gloo and compares with the same model run in this process
on one device (same initial state, same inputs): losses over 3 AdamW steps and the first step's
gradients. It also counts the collectives of the first step, and can round-trip the state through
torch.distributed.checkpoint or compare seed initialization with a single-device build. A job with
``check: "chunked"`` applies a plan with chunked state instead (``chunked_job``; ``max_norm`` clips it).
Training-loop checks (test_training.py): ``"clip"`` (``clip_job``), ``"dataloader"`` (``dataloader_job``),
``"accumulate"`` (``accumulate_job``).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist


def _factory(job):
    from cauto.profiler import zoo
    return lambda: zoo.ZOO[job["model"]](**job["kwargs"])


def run_job(job: dict, mesh, captures: dict) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    from cauto.profiler.capture import capture, loss_of, split_inputs
    from cauto.runtime.apply import apply
    from cauto.runtime.verify import counting_mode, executed_counts

    fn = _factory(job)
    key = (job["model"], json.dumps(job["kwargs"], sort_keys=True))
    if key not in captures:
        captures[key] = capture(fn)
    cap = captures[key]
    if job.get("check") == "chunked":
        return chunked_job(job, fn, cap, mesh)
    out: dict = {}
    if job.get("check") == "seed_init":
        torch.manual_seed(7)
        ref, _ = fn()
        m = apply(fn, job["plan"], mesh, seed=7, captured=cap)
        diffs = {n: float((_full(p) - ref.get_parameter(n).detach()).abs().max()) for n, p in m.named_parameters()}
        return {"init_max_diff": max(diffs.values()), "worst": max(diffs, key=diffs.get)}
    torch.manual_seed(0)
    ref, inputs = fn()
    ref.train()
    if getattr(getattr(ref, "config", None), "use_cache", False):
        ref.config.use_cache = False
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    m = apply(fn, job["plan"], mesh, state_dict=state, captured=cap, **job.get("apply", {}))
    args, kwargs = split_inputs(inputs)
    ref_args, ref_kwargs = args, kwargs
    if job.get("check") == "local_batch":  # each rank passes only its slice, as input_slices() says
        slices = m.input_slices()
        names = list(kwargs)
        kwargs = {k: v[slices[k]] for k, v in kwargs.items()}
        out["local_batch_shapes"] = {k: list(kwargs[k].shape) for k in names}
    if job.get("check") == "clip":
        return clip_job(job, m, ref, args, kwargs)
    if job.get("check") == "dataloader":
        return dataloader_job(job, m, ref, kwargs)
    if job.get("check") == "accumulate":
        return accumulate_job(job, m, ref, kwargs)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    loss_diffs, grad_diff = [], 0.0
    for step in range(3):
        ref_loss = loss_of(ref(*ref_args, **ref_kwargs))
        ref_loss.backward()
        if step == 0:
            with torch.no_grad(), CommDebugMode() as fwd:  # see verify.verify_step
                m(*args, **kwargs)
            loss = m(*args, **kwargs)
            with counting_mode() as bwd:
                loss.backward()
            out["forward"] = dict(executed_counts(fwd))
            out["backward"] = dict(executed_counts(bwd))
            out["buckets"] = len(m.grad_sync.last_buckets)
            out["overlapped_buckets"] = m.grad_sync.last_overlapped
            for name, p in m.named_parameters():
                want = ref.get_parameter(name).grad
                if p.grad is None or want is None:  # frozen (Whisper's encoder positions): both or a mismatch
                    grad_diff = grad_diff if p.grad is None and want is None else float("inf")
                    continue
                diff = float((_full(p.grad) - want).abs().max())
                if diff > grad_diff:
                    grad_diff, out["worst_grad"] = diff, name
        else:
            loss = m(*args, **kwargs)
            loss.backward()
        loss_diffs.append(abs(float(loss) - float(ref_loss)))
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
        if step == 0:  # the first update: a gradient that matched but an optimizer step that did not shows here
            diffs = {n: float((_full(p.detach()) - ref.get_parameter(n).detach()).abs().max())
                     for n, p in m.named_parameters()}
            out["param_diff"] = max(diffs.values(), default=0.0)
            out["worst_param"] = max(diffs, key=diffs.get) if diffs else None
    out.update(loss=float(loss), loss_diffs=loss_diffs, grad_diff=grad_diff,
               mismatches=len(m.executable.mismatches), redistributions=len(m.executable.redistributions))
    if job.get("check") == "dcp":
        import torch.distributed.checkpoint as dcp
        path = job["dcp_dir"]
        dcp.save(m.state_dict(), checkpoint_id=path)
        m2 = apply(fn, job["plan"], mesh, seed=123, captured=cap)
        before = float(m2(*args, **kwargs))
        sd = m2.state_dict()
        dcp.load(sd, checkpoint_id=path)
        m2.load_state_dict(sd)
        out["dcp"] = {"before": before, "after": float(m2(*args, **kwargs)), "expected": float(m(*args, **kwargs))}
    if job.get("check") == "code":
        out["code_has_redistribute"] = "redistribute" in m.generated_code
        out["code_has_checkpoint"] = "checkpoint" in m.generated_code
    if job.get("check") == "local_code":
        code = m.generated_code
        local = code[code.index("class LocalForward"):]
        forward, backward = local.split("class LocalBackward")
        out["forward_collectives"] = [line.split("# ")[-1] for line in forward.splitlines() if "COLLECTIVE" in line]
        out["backward_collectives"] = [line.split("# ")[-1] for line in backward.splitlines() if "COLLECTIVE" in line]
    return out


def clip_job(job: dict, m, ref, args, kwargs) -> dict:
    """``model.clip_grad_norm_`` vs ``torch.nn.utils.clip_grad_norm_`` on the single-process model: the
    norms of 2 AdamW steps (clipped: ``max_norm`` below the norm), the infinity norm, the clipped
    gradients of step 1 and the losses."""
    from cauto.profiler.capture import loss_of
    max_norm = job.get("max_norm", 0.05)
    if job.get("unsynced"):  # gradients left as autograd makes them (Partial on dp): clip reduces them for the norm
        m.grad_sync.remove()
        loss_of(ref(*args, **kwargs)).backward()
        m(*args, **kwargs).backward()
        partial = sum(any(q.is_partial() for q in p.grad.placements) for p in m.parameters() if hasattr(p.grad, "placements"))
        return {"partial_grads": partial, "norms": [float(m.clip_grad_norm_(max_norm))],
                "ref_norms": [float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))]}
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    out = {"norms": [], "ref_norms": [], "loss_diffs": [], "grad_diff": 0.0}
    for step in range(2):
        ref_loss = loss_of(ref(*args, **kwargs))
        ref_loss.backward()
        loss = m(*args, **kwargs)
        loss.backward()
        if step == 0:  # max |g| first (max_norm too large to clip anything)
            out["inf_norm"] = float(m.clip_grad_norm_(1e9, norm_type=float("inf")))
            out["ref_inf_norm"] = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, norm_type=float("inf")))
        out["ref_norms"].append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)))
        out["norms"].append(float(m.clip_grad_norm_(max_norm)))
        if step == 0:
            for name, p in m.named_parameters():
                g = _full(p.grad)
                out["grad_diff"] = max(out["grad_diff"], float((g - ref.get_parameter(name).grad).abs().max()))
        out["loss_diffs"].append(abs(float(loss) - float(ref_loss)))
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    return out


def dataloader_job(job: dict, m, ref, kwargs) -> dict:
    """Each rank loads only its slice (``model.batch_slice()``) through a DataLoader + DistributedSampler;
    the single-process model gets the global batch: every rank's local batch, concatenated in slice order
    (built here from every slice's own loader). Per-step losses and the first step's gradients."""
    from torch.utils.data import DataLoader, TensorDataset

    from cauto.profiler.capture import loss_of
    from cauto.runtime.data import BatchSlice
    mine = m.batch_slice()
    names = list(kwargs)
    batch = int(kwargs[names[0]].shape[0])
    steps = job.get("steps", 3)
    g = torch.Generator().manual_seed(1)
    dataset = TensorDataset(*(torch.randint(0, job["kwargs"]["vocab"], (steps * batch, *kwargs[k].shape[1:]),
                                            generator=g) for k in names))

    def loader(index):
        part = BatchSlice(index, mine.count, mine.axes)
        sampler = part.sampler(dataset, shuffle=True, seed=3)
        sampler.set_epoch(1)
        return sampler, DataLoader(dataset, batch_size=part.local_batch(batch), sampler=sampler, drop_last=True)

    sampler, own = loader(mine.index)
    everyone = [loader(i)[1] for i in range(mine.count)]
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    out = {"slice": [mine.index, mine.count], "indices": list(iter(sampler)), "loss_diffs": [], "grad_diff": 0.0,
           "local_shapes": []}
    for step, (local, *all_) in enumerate(zip(own, *everyone)):
        whole = {k: torch.cat([b[i] for b in all_]) for i, k in enumerate(names)}
        ref_loss = loss_of(ref(**whole))
        ref_loss.backward()
        loss = m(**dict(zip(names, local)))
        loss.backward()
        out["local_shapes"].append(list(local[0].shape))
        if step == 0:
            for name, p in m.named_parameters():
                out["grad_diff"] = max(out["grad_diff"], float((_full(p.grad) - ref.get_parameter(name).grad).abs().max()))
        out["loss_diffs"].append(abs(float(loss) - float(ref_loss)))
        out["loss"] = float(loss)
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
    return out


def accumulate_job(job: dict, m, ref, kwargs) -> dict:
    """Gradient accumulation: ``k`` micro-batches (the plan's batch each), all but the last under
    ``model.no_sync()``, each loss divided by k, against one single-process backward of the whole batch
    (the micro-batches concatenated). Collectives per micro-batch (CommDebugMode) and gradient buckets,
    and those of a plain one-micro-batch step (k=1) before it."""
    import contextlib

    from torch.distributed.tensor.debug import CommDebugMode

    from cauto.profiler.capture import loss_of
    from cauto.runtime.verify import counting_mode, executed_counts
    k = job["k"]
    names = list(kwargs)
    b = int(kwargs[names[0]].shape[0])
    g = torch.Generator().manual_seed(5)
    whole = {n: torch.randint(0, job["kwargs"]["vocab"], (k * b, *kwargs[n].shape[1:]), generator=g) for n in names}
    micro = [{n: v[i * b:(i + 1) * b] for n, v in whole.items()} for i in range(k)]

    def count(batch, scale):
        # forward collectives counted in a no-grad forward, as verify.count_step_collectives does
        with torch.no_grad(), CommDebugMode() as fwd:
            m(**batch)
        loss = m(**batch) / scale
        with counting_mode() as bwd:
            loss.backward()
        return [dict(executed_counts(fwd)), dict(executed_counts(bwd))], list(m.grad_sync.last_buckets)

    out = {}
    out["k1_counts"], out["k1_buckets"] = count(micro[0], 1)  # one step, no accumulation
    m.zero_grad()
    out["counts"], out["buckets"] = [], []
    for i in range(k):
        with m.no_sync() if i < k - 1 else contextlib.nullcontext():
            c, buckets = count(micro[i], k)
        out["counts"].append(c)
        out["buckets"].append(buckets)
    out["overlapped"] = m.grad_sync.last_overlapped  # buckets launched while the last backward ran
    loss_of(ref(**whole)).backward()
    out["grad_diff"] = max(float((_full(p.grad) - ref.get_parameter(n).grad).abs().max()) for n, p in m.named_parameters())
    out["grad_scale"] = max(float(p.grad.abs().max()) for p in ref.parameters())
    try:
        with m.no_sync():
            m(**micro[0]).backward()
            m.clip_grad_norm_(1.0)
        out["clip_in_no_sync"] = "allowed"
    except RuntimeError as exc:
        out["clip_in_no_sync"] = str(exc)
    return out


def _chunked_params(m) -> dict[str, torch.Tensor]:
    """Every parameter's current value (this rank's shard of it in a DTensor program) on every rank:
    all-gather every chunk group (a collective)."""
    mgr = m.manager
    mgr.begin_forward()
    mgr.gather_groups(mgr.num_groups)
    out = {s.name: s.param.detach().clone() for s in mgr.layout.slots}
    module = m.chunked.module
    for name, p in module.named_parameters():  # frozen ones: on the device, outside the chunks
        if name not in out and not p.requires_grad:
            out[name] = _full(p.detach()).clone()
    return out


def _ref_shards(m, ref, mesh) -> dict[str, torch.Tensor]:
    """The reference model's parameters cut as this rank's chunked shards are (whole in chunks/data_parallel.py)."""
    from cauto.runtime.dist_utils import local_slices
    shards = getattr(m, "_shards", {})
    out = {}
    for name, p in ref.named_parameters():
        full = p.detach()
        out[name] = full[local_slices(tuple(full.shape), shards[name].placements, mesh)] if name in shards else full
    return out


def chunked_job(job: dict, fn, cap, mesh) -> dict:
    """A plan with chunked state vs the same model trained in this process without chunks: per-step
    losses, final parameters, and the chunk manager's figures (arena, traffic of the last step)."""
    from cauto.profiler.capture import loss_of, split_inputs
    from cauto.runtime.apply import ParallelModule, apply
    from cauto.runtime.chunks.data_parallel import ChunkedParallelModule

    torch.manual_seed(0)
    ref, inputs = fn()
    ref.train()
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    lr = job.get("lr", 1e-2)
    m = apply(fn, job["plan"], mesh, state_dict=state, captured=cap,
              optimizer=lambda mod: torch.optim.AdamW(mod.parameters(), lr=lr))
    program = isinstance(m, ParallelModule)
    assert program == bool(job.get("program")) and (program or isinstance(m, ChunkedParallelModule)), type(m)
    args, kwargs = split_inputs(inputs)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr)
    opt = m.optimizer
    losses, ref_losses, norms, ref_norms = [], [], [], []
    steps = job.get("steps", 4)
    for step in range(steps):
        if step == steps - 1:
            m.manager.mover.traffic.reset()
        loss = m(*args, **kwargs)
        loss.backward()
        ref_loss = loss_of(ref(*args, **kwargs))
        ref_loss.backward()
        if job.get("max_norm") is not None:  # clipped as torch clips the single-process model
            norms.append(float(m.clip_grad_norm_(job["max_norm"])))
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), job["max_norm"])))
        opt.step()
        opt.zero_grad()
        opt_ref.step()
        opt_ref.zero_grad()
        losses.append(float(loss))
        ref_losses.append(float(ref_loss))
    traffic = m.manager.mover.traffic.to_dict()
    params = _chunked_params(m)
    want = _ref_shards(m, ref, mesh)
    diffs = {n: float((params[n] - want[n]).abs().max()) for n in want}
    worst = max(diffs, key=diffs.get)
    rel = float((params[worst] - want[worst]).norm() / want[worst].norm())
    mgr = m.manager
    from cauto.runtime.chunks.data_parallel import chunk_report
    report = chunk_report(m, (args, kwargs))  # one more step, after the comparisons: its collectives
    return {"losses": losses, "ref_losses": ref_losses, "norms": norms, "ref_norms": ref_norms,
            "collectives": report["collectives"], "param_diff": diffs[worst], "worst_param": worst,
            "param_diff_without_k_bias": max(v for n, v in diffs.items() if not n.endswith("attn.k.bias")),
            "top_param_diffs": sorted(diffs.items(), key=lambda kv: -kv[1])[:5],
            "param_rel_err": float(torch.sqrt(sum(((params[n] - want[n]) ** 2).sum() for n in want)
                                              / sum((w ** 2).sum() for w in want.values()))),
            "worst_param_rel_err": rel, "traffic": traffic,
            "arena_bytes": mgr.arena.nbytes, "nonmodel_peak_bytes": int(mgr.nonmodel_peak_bytes),
            "pinned_peak_bytes": max(mgr.trace_pinned_bytes, default=0), "num_chunks": mgr.layout.num_chunks,
            "chunk_elems": mgr.layout.chunk_elems, "world_size": mgr.world_size,
            "optimizer_on_device": any(c.fixed for c in mgr.chunks.values()),
            "local_batch": [] if program else [int(t.shape[0]) for t in m._local(list(args) + list(kwargs.values()))],
            "fetches": m.generated_code.count("fetch_chunked(") if program else 0}



def _full(t):
    """The whole tensor: a DTensor gathered, a plain (replicated) parameter or gradient as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    jobs = json.loads(open(sys.argv[4]).read())
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    from cauto.runtime.dist_utils import make_mesh

    results, captures = {}, {}
    for job in jobs:
        mesh = make_mesh(job["mesh"], job["axis_names"])
        try:
            results[job["name"]] = run_job(job, mesh, captures)
        except Exception:
            results[job["name"]] = {"error": traceback.format_exc()[-3000:]}
            break  # the other ranks may be stuck in a collective of this job: end together
    with open(sys.argv[5] + f".{rank}", "w") as fh:
        json.dump(results, fh)
    # Every rank past every collective before any rank closes its connections (as launch.py does): a rank
    # that tore its group down while a peer was still finishing the last transfer made that peer abort
    # ("terminate called without an active exception", exit -6) in one CI run.
    if not any("error" in r for r in results.values()):  # after an error the peers may be mid-collective
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # the results are written; skip interpreter finalization (no C++ teardown races left)


if __name__ == "__main__":
    tempfile.tempdir = None
    main()
