"""Automatic resume only into a checkpoint of the same job: model structure, global batch and data-order seed are recorded
in the manifest and compared before anything is loaded; a mismatch is one line (or, if asked, the checkpoint is set aside)."""

from __future__ import annotations

from dataclasses import replace

import torch

import pytest
import lightning.pytorch as pl
from lightning.pytorch import Trainer, seed_everything

import lightning_fleet
from examples.gpt.data import StdlibText
from examples.gpt.model import GPT
from lightning_fleet.elastic.checkpoint import committed
from lightning_fleet.elastic.compatibility import JobFacts, incompatibility, job_facts
from lightning_fleet.elastic.layout import MANIFEST, SET_ASIDE, Manifest
from lightning_fleet.planning import FleetError
from tests.multiprocess import QUIET_TRAINER

pytestmark = pytest.mark.usefixtures("restore_environment")  # in-process Trainers change os.environ


def fit(tmp_path, layers: int = 2, seed: int = 0, steps: int = 2, ckpt_path=None, **strategy_kwargs) -> Trainer:
    seed_everything(seed)
    strategy = lightning_fleet.FleetStrategy(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every_n_steps=1, **strategy_kwargs)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, limit_val_batches=0, **QUIET_TRAINER)
    module = GPT(num_layers=layers, hidden_size=32, num_heads=4, seq_length=32)
    trainer.fit(module, StdlibText(seq_length=32, batch_size=4, limit_bytes=20_000), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.unit
def test_manifest_records_the_job_and_the_same_job_resumes(tmp_path):
    first = fit(tmp_path)
    manifest = Manifest.from_json((committed(tmp_path / "ckpt")[0] / MANIFEST).read_text())
    assert manifest.model == first.strategy.checkpoint_facts().model
    assert manifest.data_seed == 0 and manifest.global_batch_size == 4
    again = fit(tmp_path, steps=3)
    assert again.strategy.resumed_from == committed(tmp_path / "ckpt")[1] and again.global_step == 3


@pytest.mark.unit
@pytest.mark.parametrize(
    "change,words",
    [
        (dict(layers=3), "this module has 'blocks.2."),
        (dict(seed=1), "its data order was seeded with 0, this job seeds it with 1"),
        (dict(global_batch_size=8), "trained with global batch size 4, this job asks for 8"),
    ],
)
def test_a_changed_job_is_refused_in_one_line(tmp_path, change, words):
    fit(tmp_path)
    with pytest.raises(FleetError) as err:
        fit(tmp_path, steps=3, **change)
    message = str(err.value)
    assert "\n" not in message and words in message and "resume='if_compatible'" in message


@pytest.mark.unit
def test_if_compatible_sets_the_other_jobs_checkpoints_aside_and_starts_fresh(tmp_path):
    fit(tmp_path)
    old = committed(tmp_path / "ckpt")
    trainer = fit(tmp_path, layers=3, resume="if_compatible")
    assert trainer.strategy.resumed_from is None and trainer.global_step == 2
    assert sorted(p.name for p in (tmp_path / "ckpt" / SET_ASIDE).iterdir()) == sorted(p.name for p in old)
    restarted = fit(tmp_path, layers=3, steps=3, resume="if_compatible")  # its own checkpoints are compatible
    assert restarted.strategy.resumed_from is not None and restarted.global_step == 3


@pytest.mark.unit
def test_never_starts_fresh_and_keeps_the_old_checkpoints(tmp_path):
    fit(tmp_path)
    trainer = fit(tmp_path, steps=1, resume="never")
    assert trainer.strategy.resumed_from is None and trainer.global_step == 1
    assert len(list((tmp_path / "ckpt" / SET_ASIDE).iterdir())) == 2


@pytest.mark.pure
def test_bad_resume_policy_is_one_line():
    with pytest.raises(FleetError, match="resume='sometimes'"):
        lightning_fleet.FleetStrategy(resume="sometimes")


def recorded(facts: JobFacts | None, **changes) -> Manifest:
    """The manifest a job with ``facts`` writes (None: one from before the facts were recorded)."""
    return Manifest(step=3, world_size=1, plan=None, global_batch_size=facts.global_batch_size if facts else None,
                    model=facts.model if facts else None, data_seed=facts.data_seed if facts else None, files={}, **changes)


@pytest.mark.pure
def test_facts_compare_shapes_dtypes_and_missing_tensors():
    a = job_facts(GPT(num_layers=2, hidden_size=32, num_heads=4, seq_length=32), global_batch_size=8, data_seed=0)
    wider = job_facts(GPT(num_layers=2, hidden_size=64, num_heads=4, seq_length=32), global_batch_size=8, data_seed=0)
    deeper = job_facts(GPT(num_layers=3, hidden_size=32, num_heads=4, seq_length=32), global_batch_size=8, data_seed=0)
    assert incompatibility(recorded(a), a) == ""
    assert "'tok.weight' is 256x32 float32 in the checkpoint but 256x64 float32 in this module" in incompatibility(recorded(a), wider)
    assert incompatibility(recorded(a), deeper).startswith("this module has 'blocks.2.")
    assert incompatibility(recorded(deeper), a).startswith("the checkpoint has 'blocks.2.")
    assert incompatibility(recorded(None), a) == ""  # a manifest from before facts were recorded
    assert incompatibility(recorded(a), replace(a, global_batch_size=None)) == ""  # the job does not fix it
    assert "global batch size 8, this job asks for 16" in incompatibility(recorded(a), replace(a, global_batch_size=16))
    assert "seeded with 0, this job seeds it with 1" in incompatibility(recorded(a), replace(a, data_seed=1))


@pytest.mark.unit
def test_a_plan_that_contradicts_the_checkpoints_is_one_line_and_a_compatible_one_continues(tmp_path):
    """Same world: the checkpoint's plan continues when the job's fixed keys agree with it, else one line says which clash."""
    fit(tmp_path, plan="zero=1")
    assert fit(tmp_path, steps=3, plan="zero=1").strategy.plan.zero == 1
    with pytest.raises(FleetError) as err:
        fit(tmp_path, steps=4, plan="zero=2")
    message = str(err.value)
    assert "\n" not in message and "but this job fixes zero=2: drop those from plan=/micro_batch_size=" in message


@pytest.mark.unit
def test_a_given_ckpt_path_is_continued_and_nothing_else_is_touched(tmp_path):
    """fit(ckpt_path=<step>) continues that step whatever resume= says about the directory's newest one; the newer step
    its own commit replaces is kept in set-aside, never deleted."""
    fit(tmp_path, steps=3)
    chosen = committed(tmp_path / "ckpt")[1]  # step 2, not the newest
    trainer = fit(tmp_path, steps=3, ckpt_path=str(chosen), resume="never")
    assert trainer.strategy.resumed_from == chosen and trainer.global_step == 3
    assert [p.name for p in (tmp_path / "ckpt" / SET_ASIDE).iterdir()] == ["step-000000003"]


@pytest.mark.unit
def test_a_given_ckpt_path_of_another_model_is_one_line(tmp_path):
    fit(tmp_path)
    with pytest.raises(FleetError) as err:
        fit(tmp_path, layers=3, steps=3, ckpt_path=str(committed(tmp_path / "ckpt")[0]))
    assert "\n" not in str(err.value) and "cannot be resumed by this job: this module has 'blocks.2." in str(err.value)


@pytest.mark.unit
def test_a_checkpoint_plan_this_job_may_not_run_is_one_line(tmp_path):
    """Switching to ZeRO-3 only (the fleet_zero3 preset) does not silently continue a ZeRO-1 checkpoint."""
    fit(tmp_path, plan="zero=1")
    with pytest.raises(FleetError) as err:
        fit(tmp_path, steps=3, zero_stages=(3,))
    message = str(err.value)
    assert "\n" not in message and "which this job may not run" in message and "zero=1 is outside zero_stages=(3,)" in message


@pytest.mark.unit
def test_a_plain_checkpoint_dir_is_read_by_the_restricted_unpickler(tmp_path):
    """fit(ckpt_path=<trainer.save_checkpoint dir>): a planted payload in DeepSpeed's shard is refused in one line by the
    restricted unpickler DeepSpeed's load goes through, and never runs."""
    import os as _os

    trainer = fit(tmp_path)
    plain = tmp_path / "plain"
    trainer.save_checkpoint(plain)
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (_os.system, (f"touch {marker}",))

    shard = max((p for p in plain.rglob("*.pt")), key=lambda p: p.stat().st_size)
    torch.save({"module": Payload()}, shard)
    with pytest.raises(FleetError, match="which the restricted unpickler refuses"):
        fit(tmp_path / "other", steps=3, ckpt_path=str(plain))
    assert not marker.exists()


class Dropped(pl.LightningModule):
    """An MLP with dropout: its random stream must continue across a resume exactly as without one."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.unit
def test_a_resumed_job_continues_the_random_stream(tmp_path):
    """Checkpoint mid-epoch at step 3, resume to 6: dropout draws what the uninterrupted job drew, bit for bit."""
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 8, generator=g), torch.randint(0, 3, (48,), generator=g))

    def train(directory, steps):
        seed_everything(0)
        module = Dropped()
        strategy = lightning_fleet.FleetStrategy(checkpoint_dir=str(directory), checkpoint_every_n_steps=1)
        trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, **QUIET_TRAINER)
        trainer.fit(module, DataLoader(data, batch_size=4, shuffle=True))
        return module.state_dict()

    straight = train(tmp_path / "straight", 6)
    train(tmp_path / "resumed", 3)
    resumed = train(tmp_path / "resumed", 6)
    for key, tensor in straight.items():
        assert torch.equal(tensor, resumed[key]), key


@pytest.mark.unit
def test_a_resume_reads_the_manifest_once_and_hashes_each_file_once(tmp_path, monkeypatch):
    """The checkpoint a fit continues is verified once (every file hashed once, the manifest parsed once), on the rank that
    decides; what follows (the decision, the load) reads that verified value."""
    from lightning_fleet.elastic import layout

    fit(tmp_path)
    newest = committed(tmp_path / "ckpt")[0]
    listed = set(Manifest.from_json((newest / MANIFEST).read_text()).files)
    hashed: list[str] = []
    parsed: list[int] = []
    sha256_of, from_json = layout.sha256_of, Manifest.from_json.__func__

    def counting_sha256(path):  # type: ignore[no-untyped-def]
        hashed.append(str(path.relative_to(newest)))
        return sha256_of(path)

    def counting_from_json(cls, text):  # type: ignore[no-untyped-def]
        parsed.append(1)
        return from_json(cls, text)

    monkeypatch.setattr(layout, "sha256_of", counting_sha256)
    monkeypatch.setattr(Manifest, "from_json", classmethod(counting_from_json))
    again = fit(tmp_path)  # the same max_steps: it resumes, trains nothing and saves nothing
    assert again.strategy.resumed_from == newest and again.global_step == 2
    assert sorted(hashed) == sorted(listed) and len(parsed) == 1


@pytest.mark.pure
@pytest.mark.parametrize(("optimizer", "message"), [
    ({"state": {"w": {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}},
      "param_groups": [{"lr": 0.1, "params": ["w"]}, {"lr": 0.1, "params": []}]},
     "the checkpoint's optimizer has 2 parameter groups; DeepSpeed's universal form continues one group only: relaunch "
     "with the runtime that wrote it"),
    ({"state": {"w": {"momentum_buffer": torch.zeros(2)}}, "param_groups": [{"lr": 0.1, "params": ["w"]}]},
     "the checkpoint's optimizer state of w is not Adam's (it holds momentum_buffer); DeepSpeed's universal form holds "
     "exp_avg and exp_avg_sq: relaunch with the runtime that wrote it"),
])
def test_a_state_deepspeed_cannot_import_is_one_line_and_writes_nothing(tmp_path, optimizer, message):
    """A torch checkpoint whose optimizer DeepSpeed's universal form cannot hold (several groups, SGD's momentum) is
    refused before anything is written."""
    from lightning_fleet.runtime.base import FullState
    from lightning_fleet.runtime.deepspeed.universal import _universal_from_state

    state = FullState(model={"w": torch.ones(2)}, optimizer=optimizer, client={"global_step": 3})
    with pytest.raises(FleetError) as err:
        _universal_from_state(state, tmp_path / "out", 2)
    assert str(err.value) == message and not (tmp_path / "out").exists()
