"""Worker for the evaluation tests: fit the example GPT under a plan, then validate, test and predict with the same Trainer;
with --save-to, also save it and validate/test/predict the checkpoint with a fresh Trainer, strategy and module.

Rank 0 writes per plan: the in-fit validation loss, the metrics of validate and test, its own predictions (the
DistributedSampler gives rank r the samples r, r + world, ...) and the module's weights after evaluation.

    python tests/workers/eval_gpt.py --plans "dp=2,zero=3;dp=1,tp=2" --out /tmp/r.pt [--save-to DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402

import lightning_fleet  # noqa: E402
from examples.gpt.data import StdlibText  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402
from tests.multiprocess import QUIET_TRAINER  # noqa: E402
from tests.workers.train_gpt import DATA, SIZES  # noqa: E402

QUIET = dict(accelerator="cpu", devices=2, **QUIET_TRAINER)


def evaluate(trainer: Trainer, model: GPT, dm: StdlibText, ckpt_path: str | None = None) -> dict:
    """validate, test and predict with one Trainer; the module's weights afterwards."""
    validated = trainer.validate(model, dm, ckpt_path=ckpt_path, verbose=False)[0]
    tested = trainer.test(model, dm, ckpt_path=ckpt_path, verbose=False)[0]
    predicted = trainer.predict(model, dm, ckpt_path=ckpt_path)
    state = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    return {"validate": validated, "test": tested, "predict": torch.cat(predicted), "state": state}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plans", required=True, help="';'-separated plan strings")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--save-to", default=None, help="after each fit, trainer.save_checkpoint(DIR/<plan index>), and "
                                                         "evaluate it with a fresh Trainer, strategy and module")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = []
    def fresh(plan: str) -> tuple[Trainer, GPT, StdlibText]:
        seed_everything(0)
        strategy = lightning_fleet.FleetStrategy(plan=plan, global_batch_size=args.gbs, cluster="cpu")
        trainer = Trainer(strategy=strategy, max_steps=args.steps, val_check_interval=args.steps, num_sanity_val_steps=0, **QUIET)
        return trainer, GPT(**SIZES), StdlibText(**DATA)

    for index, plan in enumerate(args.plans.split(";")):
        trainer, model, dm = fresh(plan)
        trainer.fit(model, dm)
        fit_val_loss = float(trainer.callback_metrics["val_loss"])
        result = {**evaluate(trainer, model, dm), "fit_val_loss": fit_val_loss}
        if args.save_to:
            trainer.save_checkpoint(f"{args.save_to}/{index}")
            again, untrained, data = fresh(plan)  # nothing of the fit: a new Trainer, strategy and module
            result["from_checkpoint"] = {**evaluate(again, untrained, data, ckpt_path=f"{args.save_to}/{index}"), "plan": plan}
        results.append({**result, "plan": plan})
    if trainer.global_rank == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
