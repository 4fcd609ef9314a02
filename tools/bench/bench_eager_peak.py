"""The profiler's two peaks against the real CPU allocator, on every model of the coverage benchmark.

    python tools/bench/bench_eager_peak.py [--only t5,llama] [--write]

For each model of ``bench_coverage.MODELS`` (stock ``transformers`` classes, small random-weight configs,
batch 4, 2 AdamW steps, build included):

* **eager**: ``profile(fn).peak_bytes`` against ``ground_truth.measure(fn)``, the model trained as written
  (the number a user of the profiler alone needs);
* **program**: ``profile(fn).program_peak_bytes`` against ``ground_truth.measure(fn, run="graph")``, the
  captured graph executed (what cauto's runtime runs in one process);
* the seconds ``profile`` took (this machine, 2 cores) and, where the two peaks differ, the profiler's one
  line on why.

A model the profiler refuses shows the refusal. ``--write`` puts the table under "## Eager peak" in
tools/bench/RESULTS.md. A fast subset runs in CI (packages/cauto-profiler/tests/test_eager_peak.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import transformers  # noqa: F401 - imported before any model factory runs on the meta device

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_coverage import MODELS, one_line  # noqa: E402
from results_md import replace_section  # noqa: E402

SECTION = "Eager peak"


def measure_model(name: str) -> dict:
    from cauto.profiler import profile
    from cauto.profiler.ground_truth import measure

    fn = MODELS[name][0]
    row = {"model": name, "kind": MODELS[name][1]}
    try:
        t0 = time.perf_counter()
        prof = profile(fn)
        row["s"] = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - the table shows the refusal
        row["error"] = one_line(exc)
        return row
    row.update(eager=prof.peak_bytes, program=prof.program_peak_bytes, eager_real=measure(fn).peak_bytes,
               program_real=measure(fn, run="graph").peak_bytes, why=prof.peaks_differ_because or "")
    return row


def _pct(ours: int, real: int) -> str:
    err = 100.0 * (ours - real) / real
    return "0" if ours == real else f"**{err:+.3f}%**" if abs(err) > 0.1 else f"{err:+.3f}%"


def table(rows: list[dict]) -> list[str]:
    out = ["| model | kind | profile s | eager: profiler | eager: real | error | program: profiler | "
           "program: real | error | why the peaks differ |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['kind']} | | {r['error']} | | | | | | |")
            continue
        out.append(f"| {r['model']} | {r['kind']} | {r['s']:.1f} | {r['eager']} | {r['eager_real']} | "
                   f"{_pct(r['eager'], r['eager_real'])} | {r['program']} | {r['program_real']} | "
                   f"{_pct(r['program'], r['program_real'])} | {r['why']} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", help="comma-separated model names")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(MODELS)
    rows = []
    for name in names:
        rows.append(measure_model(name))
        print(table(rows[-1:])[-1], flush=True)
    exact = sum(1 for r in rows if "error" not in r and r["eager"] == r["eager_real"])
    lines = [f"Command: `python tools/bench/bench_eager_peak.py --write` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"torch 2.13.0+cpu, transformers {transformers.__version__}, 2 cores).", "",
             "Every model of the coverage benchmark (bench_coverage.py's configs, batch 4, fp32, 2 AdamW steps, build "
             "included). Eager: the model as written against `profile(fn).peak_bytes`; program: the captured graph "
             "executed against `profile(fn).program_peak_bytes`. Truth: the CPU allocator's peak "
             "(`cauto.profiler.ground_truth.measure`).", "",
             *table(rows), "",
             f"Eager peak byte-exact on {exact} of {sum(1 for r in rows if 'error' not in r)} profiled models; "
             f"refused: {', '.join(r['model'] for r in rows if 'error' in r) or 'none'}."]
    print("\n".join(lines))
    if args.write:
        replace_section(SECTION, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
