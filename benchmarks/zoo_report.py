"""The module zoo under strategy "fleet" against plain single-process Lightning, as a table: benchmarks/ZOO.md.

    .venv/bin/python benchmarks/zoo_report.py [--out benchmarks/ZOO.md]

Runs what tests/test_zoo.py asserts (every case of tests/zoo.py trained 4 steps on 2 gloo processes with the
automatic plan and with a forced ZeRO-3 plan, then validate/test/predict with the same Trainer) and writes the
numbers behind it: the plan chosen, how the module was profiled, whether its loss depends on the micro-batch, the
largest weight difference to the reference and the validation loss of both. About 2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.multiprocess import run_worker  # noqa: E402
from tests.test_zoo import NAMES, PLANS, STEPS, WORKER, reference, tolerance  # noqa: E402
from tests.zoo import CASES  # noqa: E402


def largest_difference(result: dict, ref: dict, skip: set[str]) -> float:
    return max(float((result["state"][k] - v).abs().max()) for k, v in ref["state"].items() if k not in skip)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "ZOO.md"))
    args = parser.parse_args()
    started = time.perf_counter()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for setting, plan in PLANS.items():
            results, _ = run_worker(Path(tmp), "--cases", ",".join(NAMES), "--plan", plan, "--steps", str(STEPS), worker=WORKER, timeout=1200)
            runs[setting] = {r["case"]: r for r in results}
    lines = [
        "# The module zoo under strategy \"fleet\" vs plain single-process Lightning",
        "",
        f"`.venv/bin/python benchmarks/zoo_report.py` ({time.strftime('%Y-%m-%d')}, 2 CPU processes, gloo, {STEPS} steps, global batch 8;",
        "reference: `Trainer(devices=1)` over the same global batches, see tests/test_zoo.py). |Δw| is the largest absolute",
        "weight difference to the reference after training (BatchNorm buffers excluded: each replica keeps its own, as",
        "under DDP); tolerance 2e-5 (SGD), 1e-3 (Adam), 2e-2 (bf16).",
        "",
        "| case | idiom | plan chosen (auto) | profiled | loss depends on micro-batch | |Δw| auto | |Δw| zero=3 | val_loss fleet (auto) | val_loss reference | predictions |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in NAMES:
        case, ref = CASES[name], reference(CASES[name])
        auto, zero3 = runs["auto"][name], runs["zero3"][name]
        skip = {n for n, _ in case.module().named_buffers()} if "batchnorm" in case.features else set()
        plan = auto["plan"].split(",recompute")[0]
        same = all(bool((r["predict"].float() - ref["predict"].float()).abs().max() <= tolerance(case)) for r in (auto, zero3))
        lines.append(
            f"| {name} | {', '.join(case.features)} | {plan} | {auto['profile']} | {auto['batch_dependent']} | "
            f"{largest_difference(auto, ref, skip):.1e} | {largest_difference(zero3, ref, skip):.1e} | "
            f"{auto['validate'].get('val_loss', float('nan')):.6f} | {ref['validate'].get('val_loss', float('nan')):.6f} | "
            f"{'equal' if same else 'differ'} |"
        )
    lines += ["", f"Wall time {time.perf_counter() - started:.0f} s."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
