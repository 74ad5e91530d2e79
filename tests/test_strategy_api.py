"""Strategy registration and bad input: each mistake is one clear FleetError line before any collective can hang."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

import lightning_fleet
from examples.gpt.data import StdlibText
from examples.gpt.model import GPT
from lightning_fleet.planning import FleetError, NoFeasiblePlanError, PlanError, SpecError
from tests.multiprocess import QUIET_TRAINER


class NoHooks(LightningModule):
    """A module without fleet hooks and without a layer stack: tp and pp stay 1, no recomputation."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 16)
        self.out = nn.Linear(16, 256)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.out(self.emb(x)).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


pytestmark = pytest.mark.usefixtures("restore_environment")  # in-process Trainers change os.environ


def fit(strategy, module=None, **trainer_kwargs) -> Trainer:
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=1,
        **QUIET_TRAINER,
        limit_val_batches=0,
        **trainer_kwargs,
    )
    trainer.fit(module or GPT(num_layers=2, hidden_size=32, num_heads=4, seq_length=32), StdlibText(seq_length=32, batch_size=4, limit_bytes=20_000))
    return trainer


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


@pytest.mark.pure
@pytest.mark.parametrize(
    "name,check",
    [
        ("fleet", lambda s: s.options.zero_stages == (0, 1, 2, 3) and not s.options.require_offload),
        ("fleet_zero3", lambda s: s.options.zero_stages == (3,)),
        ("fleet_offload", lambda s: s.options.require_offload),
    ],
)
def test_strategy_names_are_registered(name, check):
    """`import lightning_fleet` makes Trainer(strategy="fleet") and its presets resolve to FleetStrategy."""
    trainer = Trainer(accelerator="cpu", devices=1, strategy=name, logger=False)
    assert isinstance(trainer.strategy, lightning_fleet.FleetStrategy)
    assert check(trainer.strategy)


@pytest.mark.unit
def test_import_is_light_and_registers_once_lightning_loads():
    """Importing lightning_fleet loads no torch or Lightning; the names appear once Lightning is imported."""
    import subprocess
    import sys

    code = (
        "import sys, lightning_fleet; assert 'torch' not in sys.modules and 'lightning' not in sys.modules, 'heavy import'; "
        "from lightning.pytorch.strategies import StrategyRegistry; "
        "assert {'fleet', 'fleet_zero3', 'fleet_offload'} <= set(StrategyRegistry.available_strategies())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.unit
def test_trained_plan_is_exposed_on_the_strategy():
    """trainer.strategy.plan is the Plan object that was trained; str() gives the plan string, naming the runtime the
    planner chose (both run zero=1 now)."""
    trainer = fit(lightning_fleet.FleetStrategy(plan="dp=1,zero=1,mbs=2", global_batch_size=4))
    assert str(trainer.strategy.plan) == "dp=1,tp=1,pp=1,zero=1,mbs=2,gas=2,recompute=none,sp=false,vpp=1,offload=none,runtime=torch"
    assert trainer.strategy.estimate.fits and trainer.global_step == 1


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs,module,error,message",
    [
        (dict(plan="dp=2"), None, NoFeasiblePlanError, "dp(2) does not divide world size 1: change the fixed values or the device count"),
        (dict(plan="dp=1,tp=4"), None, NoFeasiblePlanError, "dp(1) * tp(4) = 4 does not divide world size 1"),
        (dict(plan="dp=1,tp=3"), None, FleetError, "tp=3 cannot split blocks.0.attn.q: its 4 attention heads are not divisible by tp=3"),
        (dict(plan="dp=1,tp=2"), NoHooks(), FleetError, "defines no fleet_tensor_parallel() hook: add it or use tp=1"),
        (dict(plan="dp=1,pp=2"), NoHooks(), FleetError, "defines no fleet_pipeline() (and fleet_layers()) hook: add it or use pp=1"),
        (dict(plan="dp=1,pp=2,zero=2"), None, FleetError, "DeepSpeed's pipeline engine runs with zero <= 1, without tp and without offload"),
        (dict(plan="dp=1,recompute=full"), NoHooks(), FleetError, "recompute=full needs the layer stack: add fleet_layers()"),
        (dict(plan="dp=1,zero=3", zero_stages=(0, 1)), None, FleetError, "zero=3 is outside zero_stages=(0, 1)"),
        (dict(cluster="dgx-a100-80gb"), None, FleetError, "has 8 devices (1 nodes x 8) but this job runs 1 processes"),
        (dict(cluster="dgx-z100"), None, SpecError, "no cluster file or preset named 'dgx-z100'; presets:"),
    ],
)
def test_bad_input_is_one_clear_error(kwargs, module, error, message):
    """Each bad input raises one line naming what is wrong and what to do."""
    with pytest.raises(error) as err:
        fit(lightning_fleet.FleetStrategy(**kwargs), module)
    assert message in one_line(err)


@pytest.mark.unit
def test_model_that_fits_nowhere(tmp_path):
    """A cluster too small for the model: the error names the need, the closest plan and the remedies."""
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(
        "name: tiny\nnodes: 1\ndevices_per_node: 1\n"
        "device: {name: t, memory_gib: 0.0001, peak_tflops: {bf16: 1, fp16: 1, fp32: 1}}\n"
        "intra_node: {bandwidth_GBps: 1, latency_us: 1}\ninter_node: {bandwidth_GBps: 1, latency_us: 1}\n"
        "calibration: {memory_reserve_gib: 0, memory_reserve_fraction: 0}\n"
    )
    with pytest.raises(NoFeasiblePlanError) as err:
        fit(lightning_fleet.FleetStrategy(cluster=str(tiny)))
    message = one_line(err)
    assert "needs" in message and "with the closest plan (dp=1" in message and "add devices" in message


@pytest.mark.unit
def test_trainer_gradient_accumulation_is_refused():
    """The plan owns gradient accumulation; Trainer(accumulate_grad_batches=2) says what to use instead."""
    with pytest.raises(FleetError) as err:
        fit("fleet", accumulate_grad_batches=2)
    assert "pass FleetStrategy(global_batch_size=...) instead" in one_line(err)


@pytest.mark.pure
def test_bad_global_batch_size():
    """A non-positive global batch size is refused at construction."""
    with pytest.raises(FleetError, match="global_batch_size=0"):
        lightning_fleet.FleetStrategy(global_batch_size=0)


@pytest.mark.unit
def test_tensor_parallel_checkpoint_at_another_world_is_refused(tmp_path):
    """DeepSpeed's resharding covers data-parallel checkpoints (ZeRO 0-3); a verified tp=2 one of DeepSpeed's (a plan
    naming no runtime was written by DeepSpeed) resumed on 1 process: one clear line."""
    from lightning_fleet.elastic.checkpoint import file_table
    from lightning_fleet.elastic.layout import LATEST, MANIFEST, Manifest, state_dir

    step = tmp_path / "ckpt" / "step-000000002"
    state_dir(step).mkdir(parents=True)
    (state_dir(step) / "placeholder").write_text("shards of a tp=2 job")
    plan = "dp=1,tp=2,pp=1,zero=0,mbs=4,gas=1,recompute=none,sp=false,vpp=1,offload=none"
    meta = Manifest(step=2, world_size=2, global_batch_size=4, plan=plan, model=None, data_seed=None, files=file_table(step))
    (step / MANIFEST).write_text(meta.to_json())
    (tmp_path / "ckpt" / LATEST).write_text(step.name)
    with pytest.raises(FleetError) as err:
        fit(lightning_fleet.FleetStrategy(checkpoint_dir=str(tmp_path / "ckpt")))
    assert "resharding DeepSpeed's checkpoints to 1 processes needs a data-parallel one (tp=1, pp=1): relaunch with 2 processes" in one_line(err)


class Manual(NoHooks):
    """Manual optimization with one optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()
        return loss


class TwoOptimizers(Manual):
    """A GAN-style module: two optimizers stepped by hand (DeepSpeed drives one)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.emb.parameters(), lr=0.1), torch.optim.SGD(self.out.parameters(), lr=0.1)

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        for opt in (first, second):
            opt.zero_grad()
        loss = NoHooks.training_step(self, batch, batch_idx)
        self.manual_backward(loss)
        first.step()
        second.step()
        return loss


@pytest.mark.unit
def test_a_partial_plan_fixes_its_keys_and_the_planner_chooses_the_rest(capsys):
    """plan="dp=1,zero=1" no longer means mbs=1: the planner picks the micro-batch; the report says what was fixed."""
    trainer = fit(lightning_fleet.FleetStrategy(plan="dp=1,zero=1", global_batch_size=8))
    plan = trainer.strategy.plan
    assert plan.zero == 1 and plan.dp == 1 and plan.mbs * plan.gas == 8
    assert "fixed    dp=1,zero=1 (FleetStrategy(plan=...)); the planner chose the rest" in capsys.readouterr().out


@pytest.mark.unit
def test_micro_batch_size_is_kept(capsys):
    trainer = fit(lightning_fleet.FleetStrategy(micro_batch_size=2, global_batch_size=8))
    assert (trainer.strategy.plan.mbs, trainer.strategy.plan.gas) == (2, 4)
    assert "fixed    mbs=2 (FleetStrategy(micro_batch_size=...))" in capsys.readouterr().out


@pytest.mark.unit
def test_micro_batch_size_against_the_plan_string_is_one_line():
    with pytest.raises(PlanError) as err:
        fit(lightning_fleet.FleetStrategy(plan="mbs=4", micro_batch_size=2, global_batch_size=8))
    assert "already fixes mbs=4; it cannot also be 2" in one_line(err)


@pytest.mark.pure
@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_micro_batch_size(bad):
    with pytest.raises(FleetError, match="micro_batch_size"):
        lightning_fleet.FleetStrategy(micro_batch_size=bad)


@pytest.mark.pure
@pytest.mark.parametrize("bad", [-1, 2.5, True, "10"])
def test_bad_rebalance_interval(bad):
    with pytest.raises(FleetError, match=r"rebalance_every_n_steps=.*must be a non-negative integer \(0: never\) or None"):
        lightning_fleet.FleetStrategy(rebalance_every_n_steps=bad)
    assert lightning_fleet.FleetStrategy(rebalance_every_n_steps=0).settings.rebalance_every_n_steps == 0


@pytest.mark.unit
def test_manual_optimization_trains_one_micro_batch_per_step(capsys):
    trainer = fit(lightning_fleet.FleetStrategy(global_batch_size=4), Manual())
    assert trainer.strategy.plan.gas == 1 and trainer.global_step == 1
    assert "fixed    gas=1, no pipeline: manual optimization steps once per training_step" in capsys.readouterr().out


@pytest.mark.unit
def test_manual_optimization_refuses_a_pipeline_in_one_line():
    with pytest.raises(FleetError) as err:
        fit(lightning_fleet.FleetStrategy(plan="dp=1,pp=2"), Manual())
    assert "Manual optimizes manually, and a pipeline runs forward, backward and step itself: use pp=1" in one_line(err)


@pytest.mark.unit
def test_several_optimizers_are_refused_before_training():
    module = TwoOptimizers()
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(FleetError) as err:
        fit(lightning_fleet.FleetStrategy(runtime="deepspeed"), module)
    assert "returns 2 optimizers and 0 schedulers" in one_line(err) and "combine the parameter groups into one optimizer" in one_line(err)
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))


@pytest.mark.unit
def test_several_optimizers_train_on_the_torch_runtime():
    """Manual optimization with two optimizers (a GAN's shape): the torch runtime steps both, and "auto" takes it."""
    module = TwoOptimizers()
    before = [p.detach().clone() for p in module.parameters()]
    trainer = fit("fleet", module)
    assert trainer.strategy.decision.runtime == "torch" and trainer.global_step == 2  # Lightning counts each optimizer's step
    assert not any(torch.equal(a, b) for a, b in zip(before, module.parameters()))


@pytest.mark.unit
def test_reloading_dataloaders_is_refused_in_one_line():
    with pytest.raises(FleetError) as err:
        fit("fleet", reload_dataloaders_every_n_epochs=1)
    assert "reads the training data once at setup" in one_line(err)


@pytest.mark.unit
def test_the_module_is_handed_back_plain_unless_asked_not_to():
    """DeepSpeed's ZeRO-3 partitions the module's parameters; at the end of fit they are ordinary tensors again
    (hand_back=True)."""
    module = GPT(num_layers=2, hidden_size=32, num_heads=4, seq_length=32)
    linear = torch.nn.functional.linear
    fit(lightning_fleet.FleetStrategy(plan="zero=3,runtime=deepspeed", global_batch_size=4), module)
    assert not any(hasattr(p, "ds_id") for p in module.parameters()) and all(p.numel() > 0 for p in module.parameters())
    assert torch.nn.functional.linear is linear  # ZeRO-3 swaps it for the whole process; put back at teardown
    kept = GPT(num_layers=2, hidden_size=32, num_heads=4, seq_length=32)
    fit(lightning_fleet.FleetStrategy(plan="zero=3,runtime=deepspeed", global_batch_size=4, hand_back=False), kept)
    assert all(hasattr(p, "ds_id") for p in kept.parameters())


@pytest.mark.unit
@pytest.mark.parametrize("zero", [2, 3])
def test_fsdp_on_the_torch_runtime_hands_back_the_plain_module_and_an_optimizer_over_it(tmp_path, zero):
    """FSDP2 changes the module in place (its class and its layers', hooks, DTensor parameters); at the end of fit all
    of it is undone: the user's classes, plain parameters holding the trained weights, no hook left, deepcopy works
    (FSDP refuses it), Lightning's optimizer holds the module's own parameters and whole state, a later save works and
    plain torch trains on."""
    import copy

    from torch.distributed.tensor import DTensor

    module = GPT(num_layers=2, hidden_size=32, num_heads=4, seq_length=32)
    classes = {name: type(m) for name, m in module.named_modules()}
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    trainer = fit(lightning_fleet.FleetStrategy(plan=f"zero={zero},runtime=torch", global_batch_size=4), module)
    assert trainer.strategy.plan.zero == zero and trainer.strategy.decision.runtime == "torch"
    assert {name: type(m) for name, m in module.named_modules()} == classes
    assert all(type(p) is torch.nn.Parameter and not isinstance(p, DTensor) for p in module.parameters())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in module.modules())
    assert not any(k.startswith("_fsdp") or k == "_is_fsdp_managed_module" for m in module.modules() for k in vars(m))
    assert any(not torch.equal(before[name], p) for name, p in module.named_parameters())
    optimizer = trainer.optimizers[0]
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in held} == {id(p) for p in module.parameters()}
    assert all(not isinstance(t, DTensor) for state in optimizer.state.values() for t in state.values())
    assert all(state["exp_avg"].shape == p.shape for p, state in optimizer.state.items())
    trainer.save_checkpoint(tmp_path / "after-fit")
    assert (tmp_path / "after-fit").is_dir()
    twin = copy.deepcopy(module)
    data = StdlibText(seq_length=32, batch_size=4, limit_bytes=20_000)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    loss = twin.training_step(batch, 0)
    loss = loss["loss"] if isinstance(loss, dict) else loss
    loss.backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in twin.parameters())


@pytest.mark.unit
@pytest.mark.parametrize("after_fit", [True, False])
def test_bf16_true_evaluates(after_fit):
    """validate() in bf16-true on float inputs, after a fit and on a fresh fp32 module (converted as Lightning's plugin does)."""
    from tests.zoo import Classifier, classification_data, loaders

    module, data = Classifier(), loaders(classification_data())
    trainer = Trainer(accelerator="cpu", devices=1, strategy="fleet", precision="bf16-true", max_steps=1, limit_val_batches=2, **QUIET_TRAINER)
    if after_fit:
        trainer.fit(module, **data)
    (metrics,) = trainer.validate(module, dataloaders=data["val_dataloaders"], verbose=False)
    assert metrics["val_loss"] > 0


@pytest.mark.unit
def test_half_precision_the_device_cannot_run_is_refused_before_training_or_trains():
    """precision="16-mixed" where DeepSpeed has no fp16 kernels (e.g. an AMD EPYC CPU) is one line before the fit starts
    (its engine would raise "Type fp16 is not supported on your device" inside setup); where it has them, it trains."""
    from tests.hardware import FP16

    module = GPT(num_layers=2, hidden_size=32, num_heads=4, seq_length=32)
    before = [p.detach().clone() for p in module.parameters()]
    if FP16:
        assert fit("fleet", module, precision="16-mixed").global_step == 1
        return
    with pytest.raises(FleetError) as err:
        fit("fleet", module, precision="16-mixed")
    line = one_line(err)
    assert "precision='16-mixed' trains in fp16, which DeepSpeed cannot run on this cpu device" in line
    assert "use precision='bf16-mixed' or '32-true'" in line
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
