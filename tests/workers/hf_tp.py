"""Worker for the tensor-parallel tests: Hugging Face Llama models built from tiny configs, trained with
strategy 'fleet' at tp=2 on 2 processes (Lightning's launcher) on each runtime, one Trainer.fit per case in the same processes.

    python tests/workers/hf_tp.py --kv-heads 2,1 --out /tmp/r.pt

Rank 0 writes, per case, the trained weights (the module handed back after fit) and the parameters the engine held on
a rank, or the FleetError line the fit ended with. The same module and data build the tests' one-process reference (:func:`reference_state`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from lightning.pytorch import LightningModule, Trainer, seed_everything  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_fleet  # noqa: E402
from lightning_fleet.planning import FleetError  # noqa: E402
from tests.multiprocess import QUIET_TRAINER  # noqa: E402
from tests.workers.train_gpt import LocalParams  # noqa: E402

VOCAB, SEQ, SAMPLES, BATCH, STEPS, LR = 128, 16, 32, 4, 3, 0.1
PLAN = "dp=1,tp=2,zero=0,mbs=8,gas=1"


class Llama(LightningModule):
    """A tiny LlamaForCausalLM with the tensor-parallel hook a user writes for it."""

    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        import transformers

        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=kv_heads, vocab_size=VOCAB, max_position_embeddings=SEQ)
        self.model = transformers.LlamaForCausalLM(config)

    def fleet_tensor_parallel(self) -> dict:
        return {"num_heads": 4, "column": [r".*\.self_attn\.[qkv]_proj\.weight$", r".*\.mlp\.(up|gate)_proj\.weight$"],
                "row": [r".*\.self_attn\.o_proj\.weight$", r".*\.mlp\.down_proj\.weight$"],
                "sequence": [r".*\.(input|post_attention)_layernorm\.weight$"]}

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=LR)


def token_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(0))


def reference_state(kv_heads: int) -> dict[str, torch.Tensor]:
    """One process, no Lightning: STEPS SGD steps of the whole global batch (BATCH x 2 processes) in dataset order."""
    seed_everything(0)
    module = Llama(kv_heads)
    optimizer = module.configure_optimizers()
    ids = token_ids()
    for step in range(STEPS):
        module.training_step((ids[step * 2 * BATCH:(step + 1) * 2 * BATCH],), step).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def fit(kv_heads: int, runtime: str) -> object:
    """``runtime`` ``torch-sp``: the torch runtime with sequence parallelism."""
    seed_everything(0)
    module = Llama(kv_heads)
    counted = LocalParams()
    sequence = ",sp=true" if runtime == "torch-sp" else ""
    strategy = lightning_fleet.FleetStrategy(plan=f"{PLAN}{sequence},runtime={runtime.removesuffix('-sp')}", cluster="cpu")
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, callbacks=[counted], **QUIET_TRAINER)
    try:
        trainer.fit(module, DataLoader(TensorDataset(token_ids()), batch_size=BATCH))
    except FleetError as err:
        return str(err)
    return {
        "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "local_params": counted.local,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-heads", default="2,1", help="','-separated key/value head counts, one fit each")
    parser.add_argument("--runtimes", default="deepspeed,torch", help="','-separated runtimes (torch-sp: torch with sp=true), "
                        "each fits every head count")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = [fit(int(kv), runtime) for runtime in args.runtimes.split(",") for kv in args.kv_heads.split(",")]
    if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0 or not torch.distributed.is_initialized():
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
