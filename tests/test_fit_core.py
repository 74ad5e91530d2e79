"""The neutral fit core (lightning_fleet/fit.py) on its own: no Trainer, no Lightning strategy, no LightningModule.

A plain ``nn.Module`` with a ``training_step`` goes through the core's whole route -- begin, decide, apply, build the
engine, step batches, loss weights, save, load, hand-back -- driven by a loop of a few lines, as a face would drive it;
it trains the same weights as plain torch on the same samples, and its checkpoint loads into a fresh module. Then the
core's rank-0 idiom and the settings' one-line refusals.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fleet.calibrate.measure import WorldShape
from lightning_fleet.decide import JobOptions
from lightning_fleet.fit import FitCore, FitSettings
from lightning_fleet.planning import FleetError
from lightning_fleet.runtime import runtime_named
from tests.multiprocess import free_port

pytestmark = pytest.mark.unit

CLUSTER = (
    "name: one-cpu\nnodes: 1\ndevices_per_node: 1\n"
    "device: {name: cpu, memory_gib: 8, peak_tflops: {bf16: 1, fp16: 1, fp32: 1}}\n"
    "intra_node: {bandwidth_GBps: 10, latency_us: 1}\ninter_node: {bandwidth_GBps: 10, latency_us: 1}\n"
)


class OneProcess:
    """The Ranks of a one-process job: what a face hands the core."""

    global_rank = 0
    world_size = num_processes = 1
    is_global_zero = True
    root_device = torch.device("cpu")

    def broadcast(self, obj, src=0):  # type: ignore[no-untyped-def]
        return obj


class PlainModel(nn.Module):
    """No Lightning at all: a forward and the step the core's loop calls."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.out = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(x)))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())


def samples(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 32, (n, 8), generator=g)
    return TensorDataset(x, (x * 7 + 3) % 32)


@pytest.fixture
def one_process_group():
    """A default process group of this one process: the one an earlier in-process Trainer of this pytest process left
    (Lightning keeps it, as it keeps it between fits), else a new one, destroyed afterwards."""
    if dist.is_initialized():
        assert dist.get_world_size() == 1
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def core_for(tmp_path: Path, module: nn.Module, loader: DataLoader) -> FitCore:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    options = JobOptions(plan="dp=1,zero=0,mbs=2,runtime=torch", global_batch_size=8)
    core = FitCore(OneProcess(), options, FitSettings(cluster=str(cluster)), "torch", runtime_named("torch").load_backend())
    core.begin(module, loader, data_seed=0)
    core.decide(requested=None, directory=None, precision="32-true", shape=WorldShape(world_size=1, num_nodes=1, local_world_size=1))
    core.apply(gradient_clipping=0.0, precision_plugin=None)
    return core


def test_the_core_trains_saves_and_loads_a_plain_module_without_lightning(tmp_path, one_process_group):
    torch.manual_seed(0)
    module = PlainModel()
    reference = copy.deepcopy(module)
    loader = DataLoader(samples(), batch_size=4)
    core = core_for(tmp_path, module, loader)
    plan = core.plan
    assert plan is not None and (plan.dp, plan.mbs, plan.gas, plan.global_batch_size) == (1, 2, 4, 8)
    engine, _ = core.build_engine(module, None, None, device_rank=0)
    optimizer = core.backend.optimizer(engine, torch.optim.SGD(module.parameters(), lr=0.5), plan=plan)

    steps = 3
    for step, batch in zip(range(steps), core.step_batches(first_step=lambda: 0)):
        optimizer.zero_grad()
        assert len(batch) == plan.gas
        for micro in batch:
            (module.training_step(micro, step) * core.loss_weight(step)).backward()
        optimizer.step()

    plain = torch.optim.SGD(reference.parameters(), lr=0.5)
    data = samples()
    for step in range(steps):  # the same samples in the same order: the global batch's mean gradient
        plain.zero_grad()
        reference.training_step(data[step * 8 : (step + 1) * 8], step).backward()
        plain.step()
    for (name, trained), expected in zip(module.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(trained, expected, rtol=1e-5, atol=1e-6, msg=f"{name} differs from plain torch")

    core.save(engine, tmp_path / "saved", {"global_step": steps})
    assert core.hand_back_at_end() and core.engine is module  # DDP let go: the module itself, plain
    assert "optimizer_zero_grad" in vars(module)  # the fit's change (no zeroing between micro-batches), until undone
    core.undo_patches()
    assert "optimizer_zero_grad" not in vars(module)

    fresh = PlainModel()
    again = core_for(tmp_path, fresh, DataLoader(samples(), batch_size=4))
    engine, _ = again.build_engine(fresh, None, None, device_rank=0)
    again.backend.optimizer(engine, torch.optim.SGD(fresh.parameters(), lr=0.5), plan=again.plan)
    client = again.load(tmp_path / "saved", strict=True)
    assert client["global_step"] == steps
    for (name, loaded), expected in zip(fresh.state_dict().items(), module.state_dict().values()):
        assert torch.equal(loaded, expected), f"{name} was not loaded"


class Rank(OneProcess):
    """Rank 1 of two: what rank 0 broadcast arrives."""

    global_rank, is_global_zero = 1, False

    def __init__(self, sent: object) -> None:
        self.sent = sent

    def broadcast(self, obj, src=0):  # type: ignore[no-untyped-def]
        return self.sent


def core_on(ranks: OneProcess) -> FitCore:
    return FitCore(ranks, JobOptions(), FitSettings(), "torch", runtime_named("torch").load_backend())


def test_rank_zero_decides_and_every_rank_raises_its_fleet_error() -> None:
    assert core_on(OneProcess()).on_rank_zero(lambda: 41 + 1) == 42

    def refuse() -> None:
        raise FleetError("no plan fits")

    with pytest.raises(FleetError, match="no plan fits"):
        core_on(OneProcess()).on_rank_zero(refuse)
    with pytest.raises(FleetError, match="no plan fits"):  # rank 1 raises what rank 0 sent
        core_on(Rank(FleetError("no plan fits"))).on_rank_zero(lambda: pytest.fail("only rank 0 runs it"))
    with pytest.raises(ZeroDivisionError):  # a bug on rank 0 stays itself there
        core_on(OneProcess()).on_rank_zero(lambda: 1 / 0)


@pytest.mark.parametrize("setting, message", [
    (dict(resume="sometimes"), "FleetStrategy(resume='sometimes'): must be one of 'auto', 'if_compatible', 'never'"),
    (dict(non_finite="ignore"), "FleetStrategy(non_finite='ignore'): must be one of 'stop', 'skip'"),
    (dict(rebalance_every_n_steps=-1), "FleetStrategy(rebalance_every_n_steps=-1): must be a non-negative integer"),
])
def test_settings_refuse_bad_values_in_one_line(setting, message) -> None:
    with pytest.raises(FleetError) as err:
        FitSettings(**setting)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
