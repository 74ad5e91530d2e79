"""How long the planner takes: devices 8 ... 4096 x models 1.7B ... 1T parameters.

    .venv/bin/python benchmarks/planning_speed.py            # writes benchmarks/PLANNING_SPEED.md

Each cell is the median wall time of 5 full searches (every layout, ZeRO stage, offload,
recomputation, sp, vpp and micro-batch size; placements priced where they can win), with the
number of candidates the search counted. The target is under one second for every cell.
"""

from __future__ import annotations

import platform
import statistics
import time
from pathlib import Path

from lightning_fleet.planning import NoFeasiblePlanError, TransformerSpec, load_cluster, plan, transformer_model

MODELS = {
    # Narayanan et al. 2021, Table 1 shapes (seq 2048, vocab 51200)
    "1.7B": (24, 2304, 24, 512),
    "18.4B": (40, 6144, 48, 1024),
    "175B (GPT-3)": (96, 12288, 96, 1536),
    "1T": (128, 25600, 160, 3072),
}
NODES = [1, 4, 16, 64, 128, 384, 512]  # x 8 GPUs = 8 ... 4096 devices


def model(name: str):
    layers, hidden, heads, batch = MODELS[name]
    return transformer_model(
        TransformerSpec(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, seq_length=2048, vocab_size=51200, global_batch_size=batch)
    )


def timed(m, c, repeats: int = 5) -> tuple[float, str]:
    seconds, outcome = [], ""
    for _ in range(repeats):
        start = time.perf_counter()
        try:
            result = plan(m, c, top=5)
            outcome = f"{result.candidates} cand."
        except NoFeasiblePlanError:
            outcome = "nothing fits"
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), outcome


def main() -> None:
    base = load_cluster("dgx-a100-80gb")
    rows = ["| model \\ devices | " + " | ".join(str(n * 8) for n in NODES) + " |", "|---" * (len(NODES) + 1) + "|"]
    slowest = (0.0, "")
    for name in MODELS:
        cells = []
        for nodes in NODES:
            cluster = base.with_nodes(nodes)
            seconds, outcome = timed(model(name), cluster)
            cells.append(f"{seconds:.3f} s ({outcome})")
            slowest = max(slowest, (seconds, f"{name} on {nodes * 8} devices"))
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    headline, outcome = timed(transformer_model(TransformerSpec(name="megatron-1t", num_layers=128, hidden_size=25600, num_heads=160, seq_length=2048, vocab_size=51200, precision="fp16-mixed", global_batch_size=3072)), load_cluster("dgx-a100-80gb-x384"), repeats=9)
    text = "\n".join(
        [
            "# Planning time",
            "",
            "Command: `.venv/bin/python benchmarks/planning_speed.py`",
            f"Machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}, one process, "
            f"{time.strftime('%Y-%m-%d')}.",
            "",
            f"**Headline: the 1T-parameter model of Narayanan et al. 2021 (128 layers, hidden 25600, 160 heads, "
            f"batch 3072) on 3072 A100-80GB (384 DGX nodes): {headline:.3f} s** (median of 9; {outcome}).",
            "",
            "Median of 5 full searches per cell, devices 8 ... 4096 x models 1.7B ... 1T "
            + "(DGX A100 80GB nodes, global batch of the paper's row):",
            "",
            *rows,
            "",
            f"Slowest cell: {slowest[1]}, {slowest[0]:.3f} s (target: under 1 s for every cell).",
            "",
        ]
    )
    out = Path(__file__).with_name("PLANNING_SPEED.md")
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
