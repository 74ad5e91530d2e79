"""Profiling every zoo module (tests/zoo.py) after a short real fit: it succeeds on meta tensors, counts parameters
exactly, says whether the loss depends on the micro-batch, and leaves the module, its trainer and the RNG streams
exactly as they were."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from lightning_fleet.hooks import find_layers
from lightning_fleet.planning import Role
from lightning_fleet.profiling import Method, profile
from tests.multiprocess import QUIET_TRAINER
from tests.zoo import CASES, Case, example_batch, snapshot_differences, state_snapshot


def _fitted(case: Case, root: Path) -> tuple[torch.nn.Module, Trainer]:
    """The case's module after two real training steps and one validation batch: its metrics, kept losses and the
    trainer's logged values are not empty."""
    seed_everything(0, verbose=False)
    module = case.module()
    trainer = Trainer(
        default_root_dir=root,
        accelerator="cpu",
        devices=1,
        max_steps=2,
        limit_val_batches=1,
        val_check_interval=1,
        num_sanity_val_steps=0,
        **QUIET_TRAINER,
        **case.trainer,
    )
    trainer.fit(module, **case.data())
    return module, trainer


@pytest.mark.unit
@pytest.mark.parametrize("name", list(CASES))
def test_zoo_module_profiles_on_meta_and_is_left_unchanged(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    module, trainer = _fitted(case, tmp_path)
    batch = example_batch(case)
    assert trainer.callback_metrics, "the fit logged nothing: the trainer part of the snapshot would compare nothing"
    before = state_snapshot(module, trainer)
    result = profile(module, batch, global_batch_size=8, name=name)
    assert snapshot_differences(before, state_snapshot(module, trainer)) == []
    assert result.method is Method.META, result.fallback_reason
    assert result.fallback_reason == ""
    assert result.spec.params == sum(p.numel() for p in module.parameters())  # tied weights once
    assert result.spec.trainable_params == sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert result.batch_dependent is case.batch_dependent, result.notes


@pytest.mark.pure
def test_nested_transformer_encoder_stack_is_found() -> None:
    """nn.TransformerEncoder keeps its layers in ``encoder.layers``, two levels below the LightningModule."""
    case = CASES["transformer_encoder"]
    seed_everything(0, verbose=False)
    module = case.module()
    assert find_layers(module) is module.encoder.layers
    spec = profile(module, example_batch(case), global_batch_size=8).spec
    layers = [b for b in spec.blocks if b.role is Role.LAYER]
    assert sum(b.count for b in layers) == 2
    assert all(b.name.startswith("encoder.layers.") for b in layers)
    assert sum(b.params * b.count for b in layers) == sum(p.numel() for p in module.encoder.layers.parameters())
    pre, post = spec.blocks[0], spec.blocks[-1]
    assert pre.params == module.embed.weight.numel() and post.params == sum(p.numel() for p in module.head.parameters())
    assert spec.seq_length == 8 and spec.hidden_size == 16


@pytest.mark.pure
def test_frozen_backbone_blocks_say_what_trains() -> None:
    case = CASES["frozen_backbone"]
    seed_everything(0, verbose=False)
    module = case.module()
    spec = profile(module, example_batch(case), global_batch_size=8).spec
    (whole,) = [b for b in spec.blocks if b.role is Role.LAYER]  # Sequential of mixed types: no layer stack
    assert whole.params == sum(p.numel() for p in module.parameters())
    assert whole.trainable_params == sum(p.numel() for p in module.net[2].parameters()) == 32 * 3 + 3
    assert [b.trainable_params for b in spec.blocks if b.role is not Role.LAYER] == [None, None]  # nothing there: all of 0


@pytest.mark.pure
def test_llama_layers_come_from_its_fleet_layers_hook() -> None:
    case = CASES["llama"]
    seed_everything(0, verbose=False)
    module = case.module()
    spec = profile(module, example_batch(case), global_batch_size=8).spec
    (layer,) = [b for b in spec.blocks if b.role is Role.LAYER]
    assert (layer.name, layer.count) == ("layers.0..layers.1", 2)
    assert layer.params == sum(p.numel() for p in module.layers[0].parameters())
    assert spec.blocks[-1].params == module.head.weight.numel() + module.norm.weight.numel()  # untied head
    assert spec.tied_params == 0


def _append_loss(module, trainer) -> None:
    module.losses.append(torch.zeros(()))


def _rebind_running_mean(module, trainer) -> None:
    module.running_loss = module.running_loss * 1.0


def _bump_buffer(module, trainer) -> None:
    next(iter(module.buffers()), torch.zeros(1)).add_(1)


def _add_hook(module, trainer) -> None:
    module.net.register_forward_hook(lambda *args: None)


def _freeze_weight(module, trainer) -> None:
    module.net[0].weight.requires_grad_(False)


def _log(module, trainer) -> None:
    trainer.callback_metrics["train_loss"] = torch.tensor(0.0)


def _draw(module, trainer) -> None:
    torch.rand(1)


@pytest.mark.unit
@pytest.mark.parametrize("change", [_append_loss, _rebind_running_mean, _bump_buffer, _add_hook, _freeze_weight, _log, _draw])
def test_the_snapshot_sees_every_kind_of_change(change, tmp_path: Path) -> None:
    """The comparison above is not blind: each of these changes to a fitted module, its trainer or the RNG is seen."""
    module, trainer = _fitted(CASES["keeps_loss"], tmp_path)
    module.register_buffer("count", torch.zeros(1))
    before = state_snapshot(module, trainer)
    change(module, trainer)
    assert snapshot_differences(before, state_snapshot(module, trainer)) != []
