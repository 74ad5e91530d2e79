"""Predicted vs published throughput for the configurations of Narayanan et al. 2021, Table 1.

    .venv/bin/python benchmarks/published_configs.py         # writes benchmarks/PUBLISHED_CONFIGS.md

Each row is estimated at the published layout (tp, pp, dp = GPUs / (tp * pp)), micro-batch 1,
full activation recomputation (as in the paper), 1F1B without interleaving, fp16 mixed precision,
on DGX A100 80GB nodes, with the default (uncalibrated) cost-model constants. The paper's
TFLOP/s count recomputation (its eq. 3), so they are compared with our *hardware* TFLOP/s.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from lightning_fleet.planning import TransformerSpec, estimate, load_cluster, parse_plan, transformer_model

# name, heads, hidden, layers, tp, pp, GPUs, global batch, published TFLOP/s per GPU (Table 1)
TABLE_1 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def main() -> None:
    base = load_cluster("dgx-a100-80gb")
    rows = [
        "| model | tp | pp | dp | GPUs | batch | published TFLOP/s | predicted hardware TFLOP/s | error | predicted step s | fits | largest term after compute |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    errors = []
    for name, heads, hidden, layers, tp, pp, gpus, batch, published in TABLE_1:
        model = transformer_model(
            TransformerSpec(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, seq_length=2048, vocab_size=51200, precision="fp16-mixed", global_batch_size=batch)
        )
        cluster = base.with_nodes(gpus // 8)
        dp = gpus // (tp * pp)
        e = estimate(model, cluster, parse_plan(f"dp={dp},tp={tp},pp={pp},mbs=1,recompute=full", global_batch_size=batch))
        err = e.hardware_tflops_per_device / published - 1
        errors.append(abs(err))
        terms = {k: v for k, v in e.time.terms().items() if k != "compute"}
        second = max(terms, key=terms.__getitem__)
        rows.append(
            f"| {name} | {tp} | {pp} | {dp} | {gpus} | {batch} | {published} | {e.hardware_tflops_per_device:.1f} | {err:+.1%} | "
            f"{e.time.step_s:.2f} | {'yes' if e.fits else 'no'} | {second} {terms[second]:.2f} s |"
        )
    text = "\n".join(
        [
            "# Predicted vs published: Megatron-LM weak scaling (Narayanan et al. 2021, Table 1)",
            "",
            "Command: `.venv/bin/python benchmarks/published_configs.py`",
            "",
            __doc__.split("\n\n", 2)[2].strip(),
            "",
            *rows,
            "",
            f"Median absolute error {statistics.median(errors):.1%}, worst {max(errors):.1%}. The memory-bound operators (norms, "
            "GELU, dropout, softmax, residual adds) run at the A100's 2,039 GB/s (one read and one write an element, "
            "`device.memory_GBps`); before that term the small, data-parallel-heavy rows were over-predicted by up to 22% "
            "(median 5.9%, worst 22.4%, their non-GEMM kernels folded into a constant matmul efficiency). The model "
            "under-predicts the deepest pipelines, where our bubble and pipeline-send terms (1F1B without interleaving; whole "
            "activations sent, as DeepSpeed's engine does, where Megatron sends a 1/tp slice) add about 15% that the "
            "published runs did not pay. These constants are the uncalibrated defaults; `fleet calibrate` fits them per machine.",
            "",
        ]
    )
    out = Path(__file__).with_name("PUBLISHED_CONFIGS.md")
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
