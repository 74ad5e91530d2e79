"""The example's LightningCLI: the strategy by class path in YAML, by registered name, and bad input as exit 2."""

from __future__ import annotations

import sys

import pytest

from tests.multiprocess import ROOT, run, worker_env

pytestmark = pytest.mark.multiprocess

TRAIN = [sys.executable, str(ROOT / "examples" / "gpt" / "train.py"), "fit", "--config", str(ROOT / "examples" / "gpt" / "config.yaml")]
SMALL = [
    "--trainer.max_steps=3",
    "--trainer.val_check_interval=3",
    "--trainer.limit_val_batches=2",
    "--model.num_layers=2",
    "--model.hidden_size=32",
    "--data.limit_bytes=200000",
]


def test_yaml_class_path_trains_and_prints_the_plan(tmp_path):
    """examples/gpt/config.yaml names lightning_fleet.FleetStrategy by class path; the run prints and trains the plan."""
    done = run([*TRAIN, *SMALL, f"--trainer.default_root_dir={tmp_path}"], worker_env(tmp_path))
    assert done.returncode == 0, done.stdout[-4000:]
    assert "lightning_fleet plan for GPT" in done.stdout and "chosen   dp=" in done.stdout
    assert "`Trainer.fit` stopped: `max_steps=3` reached." in done.stdout


def test_strategy_by_registered_name(tmp_path):
    """--trainer.strategy fleet_zero3 works because the script imports lightning_fleet."""
    done = run([*TRAIN, *SMALL, "--trainer.strategy=fleet_zero3", f"--trainer.default_root_dir={tmp_path}"], worker_env(tmp_path))
    assert done.returncode == 0, done.stdout[-4000:]
    assert ",zero=3," in done.stdout


def test_pipeline_plan_trains_and_validates_through_the_pipeline(tmp_path):
    """A forced pp=2 plan from the CLI: training steps and validation both run through DeepSpeed's pipeline engine."""
    args = [*TRAIN, *SMALL, "--trainer.log_every_n_steps=1", "--trainer.strategy.init_args.plan=dp=1,pp=2,mbs=4", f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=CSVLogger", f"--trainer.logger.save_dir={tmp_path}"]
    done = run(args, worker_env(tmp_path))
    assert done.returncode == 0, done.stdout[-4000:]
    assert "chosen   dp=1,tp=1,pp=2," in done.stdout
    (metrics,) = tmp_path.rglob("metrics.csv")
    header, *rows = metrics.read_text().splitlines()
    assert "val_loss" in header and "train_loss" in header
    column = header.split(",").index("val_loss")
    assert any(row.split(",")[column] for row in rows)


@pytest.mark.parametrize(
    "arg,message",
    [
        ("--trainer.strategy.init_args.plan=dp=4", "dp(4) does not divide world size 2"),
        ("--trainer.strategy.init_args.cluster=dgx-a100-80gb", "has 8 devices (1 nodes x 8) but this job runs 2 processes"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, arg, message):
    """A lightning_fleet error ends the CLI run with exit code 2 and one line (rank 0's) naming the problem."""
    done = run([*TRAIN, *SMALL, arg, f"--trainer.default_root_dir={tmp_path}"], worker_env(tmp_path))
    assert done.returncode == 2, done.stdout[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("lightning_fleet: error:")]
    assert len(lines) == 1 and message in lines[0]
    assert "Traceback" not in done.stdout
