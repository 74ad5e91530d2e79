"""DeepSpeedBackend: a Decision applied through DeepSpeed — config, engine, step, save, load, reshard, weights.

DeepSpeed's implementation of :class:`lightning_fleet.runtime.base.Backend`. Every call into DeepSpeed that applying a
plan needs goes through here (the rooms beside it: ``config.py`` Plan -> config dict, ``pipeline.py`` the pipeline
module and schedule, ``universal.py`` resharding through DeepSpeed's universal checkpoint, ``weights.py`` full
weights out of a live engine, ``reader.py`` out of checkpoint files). Imports torch and deepspeed (lazily, at call
time, so importing it stays cheap); loaded through the runtime table (:data:`lightning_fleet.runtime.RUNTIMES`) and
called by the fit core (:mod:`lightning_fleet.fit`) and the Lightning faces.
"""

from __future__ import annotations

import argparse
import math
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Sequence

import torch

from lightning_fleet.elastic.checkpoint import VerifiedCheckpoint
from lightning_fleet.elastic.layout import TAG, state_dir, universal_dir
from lightning_fleet.planning import FleetError, Plan, Precision, Recompute, parse_plan
from lightning_fleet.runtime.base import ENGINE_CHECK, Capabilities, FitView, FullState, TensorParallelSpec
from lightning_fleet.runtime.common import checkpointed_forward, engine_zeroes_gradients
from lightning_fleet.runtime.deepspeed.capabilities import DEEPSPEED
from lightning_fleet.runtime.deepspeed.checked_engine import checked_loads
from lightning_fleet.runtime.deepspeed.config import deepspeed_config
from lightning_fleet.runtime.deepspeed.pipeline import build_pipeline, local_optimizer, micro_batch_iterator, sync_stage_weights
from lightning_fleet.runtime.deepspeed.universal import make_universal, state_of_universal, universal_from_state
from lightning_fleet.runtime.deepspeed.weights import ModuleRecord, record_module, restore_module, write_layout


class DeepSpeedBackend:
    """Applies a plan with stock DeepSpeed (ZeRO 0-3, offload, AutoTP, its pipeline engine)."""

    capabilities: Capabilities = DEEPSPEED
    """What DeepSpeed executes (the planner, the CLI and the benchmarks read the same value)."""

    def config(
        self, plan: Plan, *, gradient_clipping: float, device_type: str, tensor_parallel: TensorParallelSpec | None, universal: bool
    ) -> dict[str, Any]:
        """The DeepSpeed config of ``plan``; ``universal``: the engine loads a resharded (universal) checkpoint."""
        config = deepspeed_config(
            plan,
            gradient_clipping=gradient_clipping,
            overlap_comm=device_type == "cuda",  # separate streams on GPUs; nothing to overlap on CPU/gloo
            tensor_parallel=tensor_parallel,
        )
        if universal:
            config["checkpoint"] = {"load_universal": True}
        return config

    def preload(self) -> None:
        """Import DeepSpeed, as a training process has it loaded (``fleet calibrate`` measures its memory baseline after it)."""
        import deepspeed  # noqa: F401

    def precision_refusal(self, precision: str, device_type: str) -> str | None:
        """One line when DeepSpeed cannot train the Lightning ``precision`` on this kind of device, else None.

        Its engine refuses a half type the accelerator lacks ("Type fp16 is not supported on your device",
        deepspeed/runtime/engine.py ``_do_sanity_check``), after Lightning started the fit; on a CPU, fp16 needs oneDNN's
        fp16 kernels (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: AVX512-FP16 or AMX-FP16, which e.g. AMD EPYC
        lacks; deepspeed/accelerator/cpu_accelerator.py ``is_fp16_supported``)."""
        from deepspeed.accelerator import get_accelerator

        dtype = Precision.from_lightning(precision).compute_dtype
        accelerator = get_accelerator()
        supported = {"fp16": accelerator.is_fp16_supported, "bf16": accelerator.is_bf16_supported}.get(dtype, lambda: True)()
        if supported:
            return None
        return (
            f"precision={precision!r} trains in {dtype}, which DeepSpeed cannot run on this {device_type} device (its "
            f"accelerator '{accelerator.device_name()}' has no {dtype} kernels here): use precision='bf16-mixed' or "
            f"'32-true' with strategy 'fleet'"
        )

    def process_globals(self) -> Iterable[tuple[Any, str]]:
        """Process-wide attributes an engine may replace, for the caller to put back: ZeRO-3 replaces
        ``torch.nn.functional.linear`` ("This will persist unless manually reset",
        deepspeed/runtime/zero/partition_parameters.py)."""
        return [(torch.nn.functional, "linear")]

    def module_patches(self, module: torch.nn.Module, plan: Plan, layers: Iterable[torch.nn.Module] | None,
                       precision: Any) -> list[tuple[Any, str, Any]]:
        """(object, attribute, value) changes the module needs for this plan, applied by the caller for one fit and undone
        at its end: full recomputation of each layer outside a pipeline (the pipeline checkpoints its own layers), and
        no gradient zeroing by Lightning under automatic optimization (DeepSpeed zeroes after every real optimizer step;
        Lightning's zero_grad runs after a step's first gas-1 micro-batches and must not wipe them)."""
        patches: list[tuple[Any, str, Any]] = []
        if plan.recompute is Recompute.FULL and plan.pp == 1 and layers is not None:
            patches += [(layer, "forward", checkpointed_forward(layer.forward)) for layer in layers]
        if getattr(module, "automatic_optimization", True):
            patches.append((module, "optimizer_zero_grad", engine_zeroes_gradients))
        return patches

    def build(
        self,
        module: torch.nn.Module,
        optimizer: Any,
        scheduler: Any,
        *,
        plan: Plan,
        config: dict[str, Any],
        device_rank: int,
        layers: Sequence[torch.nn.Module] | None,
    ) -> tuple[Any, Any]:
        """(engine, its optimizer): the pipeline module built first when ``plan.pp > 1`` (over the layer stack, by its
        layers' class), then ``deepspeed.initialize`` on the live process group."""
        import deepspeed
        from deepspeed.utils import groups

        if plan.tp == 1:
            # an earlier AutoTP fit in this process left its model-parallel unit in deepspeed.utils.groups (set by
            # runtime/engine.py _configure_distributed_model, never reset): this engine would take itself for
            # model-parallel and ask a unit it was not given for its rank (AttributeError inside DeepSpeedEngine)
            groups.mpu = None
        if plan.pp > 1:
            assert layers, "a pipeline plan needs the layer stack (the capabilities say so)"
            module = build_pipeline(module, plan, layer_type=type(layers[0]).__name__)
            optimizer = local_optimizer(optimizer, module) if optimizer is not None else None
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=device_rank),
            config=config,
            model=module,
            model_parameters=filter(lambda p: p.requires_grad, module.parameters()),
            optimizer=optimizer,
            lr_scheduler=scheduler,
            dist_init_required=False,
        )
        check = getattr(engine, "first_dataloader_check", None)
        if check is not None:
            # DeepSpeed's one-shot TP input check compares nested batches with `!=` and crashes on Lightning's
            # (batch, batch_idx) arguments; the sampler gives every rank of a tp group the same data-parallel slice
            # (Plan.coordinates), which the tests check instead.
            check.remove()
        return engine, ds_optimizer

    averages_micro_batches: bool = True
    """The engine scales each micro-batch's loss by 1/gas itself (its ``gradient_accumulation_steps``)."""
    zeroes_gradients: bool = True
    """The engine zeroes gradients after each optimizer step."""

    def gradient_check(self, plan: Plan) -> str:
        """``engine``: DeepSpeed keeps the reduced gradient in its own (ZeRO: partitioned) buffers, and its optimizer
        wrappers skip a step whose gradient overflowed."""
        return ENGINE_CHECK

    def no_sync(self, engine: Any) -> ContextManager[Any]:
        """A micro-batch that is not its step's last: DeepSpeed defers the reduction itself (gradient accumulation)."""
        return nullcontext()

    def accumulate(self, engine: Any, loss: torch.Tensor, backward: Callable[[torch.Tensor], Any]) -> None:
        """Backward of one micro-batch that is not the step's last through the engine (not Lightning's ``backward``);
        DeepSpeed counts the micro-step and updates only at the accumulation boundary."""
        engine.backward(loss)
        engine.step()

    def pipeline_step(self, engine: Any, micro_batches: list[Any]) -> torch.Tensor:
        """One optimizer step through DeepSpeed's pipeline schedule (forward, backward and step of every micro-batch)."""
        return engine.train_batch(micro_batch_iterator(micro_batches))

    def gather_stages(self, engine: Any, module: torch.nn.Module) -> None:
        """Every pipeline stage's current weights into every rank's module (collective)."""
        sync_stage_weights(engine, module)

    def save(self, engine: Any, directory: str | Path, client_state: dict[str, Any]) -> None:
        """DeepSpeed's sharded checkpoint of ``engine`` under ``directory`` (every rank), with Lightning's loop and
        callback state as client state (the weights and optimizer states are the engine's own shards)."""
        kept = {k: v for k, v in client_state.items() if k not in ("state_dict", "optimizer_states")}
        engine.save_checkpoint(directory, client_state=kept, tag=TAG, exclude_frozen_parameters=False)

    def load(
        self, engine: Any, directory: str | Path, *, optimizer_states: bool, strict: bool, checkpoint: VerifiedCheckpoint | None
    ) -> dict[str, Any]:
        """Load a checkpoint this engine's plan wrote (or its universal form) under the tag Lightning saves with (never
        DeepSpeed's ``latest`` file) and return the client state. Every file is unpickled without running code and, when
        ``checkpoint`` is given, checked against its manifest as it is read (runtime/deepspeed/checked_engine.py)."""
        if not (Path(directory) / TAG).is_dir():
            raise FleetError(f"DeepSpeed found no checkpoint under {directory} (no '{TAG}' directory): point ckpt_path at a FleetCheckpoint step or a trainer.save_checkpoint dir")
        with checked_loads(engine, checkpoint):
            _, client_state = engine.load_checkpoint(
                directory, tag=TAG, load_optimizer_states=optimizer_states, load_lr_scheduler_states=False, load_module_strict=strict
            )
        if client_state is None:
            raise FleetError(f"DeepSpeed found no checkpoint under {directory}: point ckpt_path at a FleetCheckpoint step or a trainer.save_checkpoint dir")
        return client_state

    def reshard(self, checkpoint: VerifiedCheckpoint) -> VerifiedCheckpoint:
        """Rank 0: the universal form of a data-parallel checkpoint written at another world size (converted once, then
        listed in its manifest), which every ZeRO stage 1-3 loads at any data-parallel size."""
        source = parse_plan(checkpoint.manifest.plan or "")
        return make_universal(checkpoint, source.zero)

    def export_state(self, checkpoint: VerifiedCheckpoint) -> FullState:
        """Rank 0: the whole state of a data-parallel DeepSpeed checkpoint, read from its universal form (converted
        once, listed in its manifest): fp32 masters as the weights, Adam's moments, Lightning's client state."""
        return state_of_universal(self.reshard(checkpoint))

    def import_state(self, checkpoint: VerifiedCheckpoint, state: FullState) -> VerifiedCheckpoint:
        """Rank 0: another runtime's checkpoint as a universal form beside it (listed in its manifest), which ZeRO 1-3
        load at any data-parallel size."""
        return universal_from_state(checkpoint, state)

    def derived_of(self, checkpoint: VerifiedCheckpoint) -> Path:
        """Where :meth:`reshard` and :meth:`import_state` put a checkpoint's universal form."""
        return universal_dir(checkpoint.path)

    def record(self, module: torch.nn.Module) -> ModuleRecord:
        """What the module is before the engine replaces, partitions or hooks it (what :meth:`hand_back` restores)."""
        return record_module(module)

    def hand_back_bytes(self, record: ModuleRecord) -> int:
        """Host bytes one process needs to hand the module back: every tensor gathered whole, in fp32."""
        return sum(4 * math.prod(t.shape) for t in record.tensors if t.alias_of is None)

    def hand_back(self, fit: FitView, record: ModuleRecord) -> None:
        """End of fit (collective): the fit's module becomes a plain module again, with the trained weights (the engine
        stays, for saving)."""
        restore_module(fit, record)

    def write_layout(self, fit: FitView, directory: str | Path, record: ModuleRecord | None) -> None:
        """After :meth:`save` (every rank; rank 0 writes): the layout file that lets the reader rebuild full weights
        from this plan's shards without the model's code."""
        write_layout(fit, directory, record)

    def state_of(self, step: Path) -> Path:
        """Where a FleetCheckpoint step keeps this runtime's checkpoint."""
        return state_dir(step)
