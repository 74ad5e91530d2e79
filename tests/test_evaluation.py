"""Tier 3: validate, test and predict under every plan kind equal one plain process (real gloo, real DeepSpeed, 2 processes).

The example GPT is trained for 4 steps under data parallel shard level 3, tensor parallel (DTensor and AutoTP) and
pipeline parallel plans; then the same Trainer validates, tests and predicts, and a fresh Trainer and a fresh module do the same from
the checkpoint the fit saved. Every metric must equal the single-process reference model's on the whole
validation set (the ranks of a tp or pp group see the same samples; the data-parallel replicas split them), the
predictions of rank 0 must be the reference's for its samples, and after evaluation the user's module is a plain
module holding the trained weights.
"""

from __future__ import annotations

import pytest
import torch

from examples.gpt.data import StdlibText
from examples.gpt.model import GPT
from tests.multiprocess import ROOT, run_worker
from tests.reference import reference_run
from tests.workers.train_gpt import DATA, SIZES

pytestmark = pytest.mark.multiprocess

WORKER = ROOT / "tests" / "workers" / "eval_gpt.py"
STEPS, GBS = 4, 8
PLANS = ["dp=2,zero=3", "dp=1,tp=2,zero=0", "dp=1,tp=2,zero=0,runtime=deepspeed", "dp=1,pp=2,zero=1"]
"""The planner's runtime for shard level 3 and tp (torch: FSDP2, DTensor), DeepSpeed's AutoTP, DeepSpeed's pipeline."""
PLAN_ARG = ";".join(PLANS)


@pytest.fixture(scope="module")
def reference() -> dict:
    """The reference model's weights, mean validation loss over every window, and predictions of every window."""
    _, state = reference_run(STEPS, GBS)
    model = GPT(**SIZES)
    model.load_state_dict(state)
    dm = StdlibText(**DATA)
    dm.setup("validate")
    xs, ys = zip(*(dm.val_set[i] for i in range(len(dm.val_set))))
    x, y = torch.stack(xs), torch.stack(ys)
    with torch.no_grad():
        logits = model(x)
        losses = torch.stack([torch.nn.functional.cross_entropy(logits[i], y[i]) for i in range(len(x))])
    return {"state": state, "loss": float(losses.mean()), "predict": logits.argmax(-1)}


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory) -> tuple[dict, dict]:
    """(after fit with the same Trainer, from the checkpoint with a fresh Trainer, strategy and module), per plan; one job."""
    tmp = tmp_path_factory.mktemp("evaluation")
    after_fit, _ = run_worker(tmp, "--plans", PLAN_ARG, "--steps", str(STEPS), "--gbs", str(GBS), "--save-to", str(tmp / "ckpt"),
                              worker=WORKER)
    return dict(zip(PLANS, after_fit)), {plan: result["from_checkpoint"] for plan, result in zip(PLANS, after_fit)}


@pytest.mark.parametrize("source", ["after_fit", "from_checkpoint"])
@pytest.mark.parametrize("plan", PLANS)
def test_metrics_and_predictions_equal_one_process(plan, source, evaluated, reference):
    result = evaluated[0 if source == "after_fit" else 1][plan]
    assert result["validate"]["val_loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert result["test"]["test_loss"] == pytest.approx(reference["loss"], rel=1e-5)
    torch.testing.assert_close(result["predict"], reference["predict"][0::2])  # rank 0's samples: 0, 2, 4, ...
    for name, tensor in reference["state"].items():
        torch.testing.assert_close(result["state"][name], tensor, atol=2e-5, rtol=0, msg=f"{plan} {source}: {name}")


@pytest.mark.parametrize("plan", PLANS)
def test_validation_inside_fit_sees_one_model(plan, evaluated, reference):
    """The validation run at the end of fit (val_check_interval = the last step) logs the reference's loss."""
    assert evaluated[0][plan]["fit_val_loss"] == pytest.approx(reference["loss"], rel=1e-5)
