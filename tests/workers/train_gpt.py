"""Worker for the multi-process tests: train the example GPT with strategy 'fleet' and report.

Runs one Trainer.fit per plan (same processes, same process group), and after each writes, on rank
0, the eval loss of the trained weights on a fixed batch and the full weights to --out.

    python tests/workers/train_gpt.py --plans "dp=2,zero=0;dp=2,zero=3" --out /tmp/r.pt
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402

import lightning_fleet  # noqa: E402
from examples.gpt.data import StdlibText  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402
from tests.multiprocess import QUIET_TRAINER  # noqa: E402

SIZES = dict(num_layers=2, hidden_size=32, num_heads=4, seq_length=32)
DATA = dict(seq_length=32, batch_size=4, limit_bytes=60_000)


def eval_batch(dm: StdlibText) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch: the first 16 training windows."""
    dm.setup("fit")
    xs, ys = zip(*(dm.train_set[i] for i in range(16)))
    return torch.stack(xs), torch.stack(ys)


class LocalParams(Callback):
    """This rank's parameter elements at the end of training, before the module is handed back (a DTensor's local shard;
    DeepSpeed's engine module as it holds them), and how many parameters its torch optimizer holds state for."""

    local = 0
    states = 0

    def on_train_end(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        engine = trainer.strategy.engine
        module = getattr(engine, "module", engine)
        self.local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in module.parameters())
        self.states = len(getattr(trainer.optimizers[0], "state", {})) if trainer.optimizers else 0


class SaveAt(Callback):
    """``trainer.save_checkpoint(path)`` after optimizer step ``step``, in the middle of the fit (as ModelCheckpoint
    saves), so one job gives both the uninterrupted run and the checkpoint a second job continues."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def full_state(trainer: Trainer, model: GPT) -> dict[str, torch.Tensor]:
    """The whole model's weights on every rank (ZeRO-3 partitions gathered)."""
    import deepspeed

    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=any(hasattr(p, "ds_id") for p in params)):
        return {k: v.detach().clone().float() for k, v in model.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plans", default="auto", help="';'-separated plan strings, or 'auto'")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--cluster", default=None)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--clip", type=float, default=0.0, help="Trainer(gradient_clip_val=...)")
    parser.add_argument("--save-to", default=None, help="after each fit, trainer.save_checkpoint to DIR/<plan index>")
    parser.add_argument("--save-at", type=int, default=None, help="with --save-to: save after this step instead, mid-fit")
    parser.add_argument("--resume-from", default=None, help="fit(ckpt_path=DIR/<plan index>)")
    parser.add_argument("--resume-index", type=int, default=None, help="resume every plan from DIR/<this index> instead")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = []
    for index, plan in enumerate(args.plans.split(";")):
        seed_everything(0)
        model = GPT(**SIZES)
        dm = StdlibText(**DATA)
        strategy = lightning_fleet.FleetStrategy(plan=None if plan == "auto" else plan, global_batch_size=args.gbs, cluster=args.cluster)
        counted = LocalParams()
        saving = [SaveAt(args.save_at, f"{args.save_to}/{index}")] if args.save_to and args.save_at is not None else []
        trainer = Trainer(
            accelerator="cpu",
            devices=args.devices,
            strategy=strategy,
            callbacks=[counted, *saving, *QUIET_TRAINER.get("callbacks", [])],  # a wrapping worker may add its own
            precision=args.precision,
            gradient_clip_val=args.clip or None,
            max_steps=args.steps,
            **{key: value for key, value in QUIET_TRAINER.items() if key != "callbacks"},
            limit_val_batches=0,
            num_sanity_val_steps=0,
        )
        saved = index if args.resume_index is None else args.resume_index
        trainer.fit(model, dm, ckpt_path=f"{args.resume_from}/{saved}" if args.resume_from else None)
        if args.save_to and args.save_at is None:
            trainer.save_checkpoint(f"{args.save_to}/{index}")
        x, y = eval_batch(dm)
        if trainer.strategy.plan.pp > 1:  # each stage holds only its layers: evaluate through the pipeline
            from lightning_fleet.runtime.deepspeed.pipeline import evaluate

            loss = float(evaluate(trainer.strategy.deepspeed_engine, (x, y)))
        else:
            with torch.no_grad():
                loss = float(model.loss((x, y)))
        plan = trainer.strategy.plan
        sharded = plan.pp > 1 or plan.tp > 1 and plan.runtime == "deepspeed"  # DeepSpeed's AutoTP keeps its split layers
        state = {} if sharded else full_state(trainer, model)
        results.append(
            {
                "plan": str(trainer.strategy.plan),
                "eval_loss": loss,
                "global_step": trainer.global_step,
                "state": state,
                "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
                "world_size": trainer.world_size,
                "local_params": counted.local,
                "optimizer_states": {"training": counted.states, "after": len(trainer.optimizers[0].state),
                                     "params": len(list(model.parameters()))},
            }
        )
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0 and trainer.global_rank == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
