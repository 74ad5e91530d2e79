"""Worker for the zoo tests: train every named zoo case under strategy "fleet" on 2 processes, then validate, test and
predict with the same Trainer; rank 0 writes what a single process must reproduce.

    python tests/workers/zoo_worker.py --cases item_logging,llama --plan auto --steps 4 --out /tmp/r.pt
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
from tests.multiprocess import QUIET_TRAINER  # noqa: E402
from tests.zoo import CASES, Case, evaluation_kwargs  # noqa: E402

QUIET = dict(**QUIET_TRAINER, num_sanity_val_steps=0)


def run_case(case: Case, plan: str | None, cluster: str | None, steps: int, runtime: str = "auto") -> dict:
    """Fit, then validate/test/predict one case; the module's weights after fit and what each stage returned."""
    seed_everything(0)
    module, data = case.module(), case.data()
    strategy = lightning_fleet.FleetStrategy(plan=plan, cluster=cluster, runtime=runtime)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, **QUIET, **case.trainer)
    trainer.fit(module, **data)
    state = {k: v.detach().clone().float() for k, v in module.state_dict().items()}
    evaluation = evaluation_kwargs(data)
    return {
        "case": case.name,
        "plan": str(trainer.strategy.plan),
        "runtime": trainer.strategy.decision.runtime,
        "profile": trainer.strategy.profile.method.value,
        "batch_dependent": trainer.strategy.profile.batch_dependent,
        "global_step": trainer.global_step,
        "state": state,
        "validate": trainer.validate(module, **evaluation, verbose=False)[0],
        "test": trainer.test(module, **evaluation, verbose=False)[0],
        "predict": torch.cat(trainer.predict(module, **evaluation)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True, help="comma-separated zoo case names")
    parser.add_argument("--plan", default="auto", help="'auto' or (partial) plan strings separated by ';', the i-th case "
                                                        "trained under the (i mod n)-th")
    parser.add_argument("--cluster", default=None, help="cluster preset or YAML (default: measure this machine)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runtime", default="auto", help="FleetStrategy(runtime=...)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    plans = [None if plan == "auto" else plan for plan in args.plan.split(";")]
    results = [run_case(CASES[name], plans[i % len(plans)], args.cluster, args.steps, args.runtime)
               for i, name in enumerate(args.cases.split(","))]
    if int(torch.distributed.get_rank()) == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
