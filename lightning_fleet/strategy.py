"""FleetStrategy: profile the LightningModule, read the cluster, plan, and train the plan with DeepSpeed.

It extends Lightning's DeepSpeedStrategy at its seams and holds no cost logic: the planning core
chooses, :func:`lightning_fleet.runtime.deepspeed_config.deepspeed_config` translates, DeepSpeed runs.
On CPU it lifts Lightning's CUDA-only restriction so DeepSpeed's CPU accelerator (gloo) is used.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping

import psutil

from lightning_fleet import noise

noise.install()  # before DeepSpeed is first imported: its accelerator banner comes at import time

import torch  # noqa: E402
from lightning.fabric.utilities.seed import reset_seed  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

from lightning_fleet import calibrate
from lightning_fleet.data import TrainingData, example_batch, inspect_training_loader, step_loader
from lightning_fleet.elastic.callback import FleetCheckpoint
from lightning_fleet.elastic.checkpoint import MANIFEST, committed, newest_verified, refuse_unsafe_pickles, set_aside, verify
from lightning_fleet.elastic.compatibility import RESUME_POLICIES, incompatibility, job_facts
from lightning_fleet.elastic.reshard import make_universal
from lightning_fleet.elastic.sampler import MicroBatches
from lightning_fleet.elastic.worker import (
    announce_launch_advice,
    deterministic,
    deterministic_errors,
    install_error_hook,
    open_process_group,
)
from lightning_fleet.export import lightning_checkpoint, record_module, restore_module, write_layout
from lightning_fleet.planning import (
    ClusterSpec,
    Estimate,
    FleetError,
    ModelSpec,
    Offload,
    PartialPlan,
    Plan,
    PlanResult,
    Precision,
    Recompute,
    estimate,
    load_cluster,
    narrow,
    parse_partial_plan,
    parse_plan,
)
from lightning_fleet.planning import plan as search_plans
from lightning_fleet.planning.cluster import GIB
from lightning_fleet.planning.plan import field_text
from lightning_fleet.profiling import Profile, find_layers, profile, tensor_parallel_hook
from lightning_fleet.progress import FleetProgress
from lightning_fleet.registration import PRESETS
from lightning_fleet.rng import RngState
from lightning_fleet.runtime.deepspeed_config import deepspeed_config, runtime_constraints
from lightning_fleet.runtime.pipeline import (
    build_pipeline,
    local_optimizer,
    micro_batch_iterator,
    pipeline_hook,
    sync_stage_weights,
)

_PRECISIONS = {
    "32-true": Precision.FP32,
    "32": Precision.FP32,
    "bf16-mixed": Precision.BF16_MIXED,
    "bf16-true": Precision.BF16_MIXED,
    "16-mixed": Precision.FP16_MIXED,
    "16-true": Precision.FP16_MIXED,
}


class FleetStrategy(DeepSpeedStrategy):
    """Chooses the parallel layout (ZeRO stage, offload, tp, micro-batch, accumulation, recomputation) and trains it.

    ``Trainer(strategy="fleet")`` after ``import lightning_fleet``; or ``FleetStrategy(...)`` with:

    Args:
        plan: fix axes of the layout, e.g. ``"zero=3"`` or ``"dp=2,zero=3,mbs=4"``: the keys given are fixed, the planner
            chooses the rest (validated against the world, the module and the runtime); None: plan everything.
        global_batch_size: samples per optimizer step; None: the training DataLoader's batch size
            times the world size (what plain DDP would use).
        cluster: cluster YAML path, preset name or ClusterSpec overriding detection; None: measure
            this machine (cached per host).
        allow_offload: let the planner offload optimizer states or parameters to host memory.
        require_offload: only consider plans that offload (the ``fleet_offload`` preset).
        max_tp: largest tensor-parallel degree (needs the module's ``fleet_tensor_parallel()``).
        max_pp: largest pipeline degree.
        zero_stages: ZeRO stages the planner may choose from.
        top: how many plans the start-up table lists.
        checkpoint_dir: add a :class:`~lightning_fleet.elastic.callback.FleetCheckpoint` saving here
            (unless the Trainer already has one); jobs resume from its newest verified checkpoint.
        checkpoint_every_n_steps: its step interval.
        checkpoint_every_n_seconds: its time interval.
        timeout: collective timeout, so a dead peer fails the job instead of hanging it.
        micro_batch_size: fix the micro-batch size (samples per forward/backward per data-parallel replica); the
            planner chooses the rest. Pin it when the loss depends on the micro-batch (BatchNorm, in-batch negatives,
            a summed loss): it is then also kept when a resized job re-plans. None: the planner chooses (and keeps the
            training DataLoader's batch size when profiling finds the loss depends on the micro-batch).
        resume: what a fit without ``ckpt_path`` does with the newest checkpoint in ``checkpoint_dir``: ``"auto"``
            resumes it and refuses (one line) one written by another model, global batch or data-order seed;
            ``"if_compatible"`` resumes the newest compatible one and moves incompatible ones aside (into
            ``<dir>/set-aside/``); ``"never"`` starts fresh and moves existing checkpoints aside (nothing is deleted).
        progress: print one line of progress (step, loss, measured vs predicted step time) every
            ``Trainer(log_every_n_steps)`` steps on rank 0 when the progress bar is off, and a summary at the end.
        hand_back: at the end of fit, give the module back as a plain module holding the trained weights on every rank
            (on the CPU, as Lightning's teardown leaves it); skipped when that would not fit the host's memory.
    """

    strategy_name = "fleet"

    def __init__(
        self,
        plan: str | None = None,
        global_batch_size: int | None = None,
        cluster: str | Path | ClusterSpec | None = None,
        allow_offload: bool = True,
        require_offload: bool = False,
        max_tp: int | None = None,
        max_pp: int | None = None,
        zero_stages: tuple[int, ...] | list[int] = (0, 1, 2, 3),
        top: int = 3,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every_n_steps: int | None = None,
        checkpoint_every_n_seconds: float | None = None,
        timeout: timedelta = timedelta(minutes=10),
        micro_batch_size: int | None = None,
        resume: str = "auto",
        progress: bool = True,
        hand_back: bool = True,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
    ) -> None:
        install_error_hook()  # an uncaught FleetError is one line per job (and, when deterministic, no restart loop)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        for name, value in (("global_batch_size", global_batch_size), ("micro_batch_size", micro_batch_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise FleetError(f"FleetStrategy({name}={value!r}): must be a positive integer or None")
        if resume not in RESUME_POLICIES:
            raise FleetError(f"FleetStrategy(resume={resume!r}): must be one of {', '.join(map(repr, RESUME_POLICIES))}")
        self.forced_plan = plan
        self.global_batch_size = global_batch_size
        self.cluster_source = cluster
        self.allow_offload = allow_offload or require_offload
        self.require_offload = require_offload
        self.max_tp, self.max_pp = max_tp, max_pp
        self.zero_stages = tuple(zero_stages)
        self.top = top
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = (checkpoint_every_n_steps, checkpoint_every_n_seconds)
        self.resumed_from: Path | None = None
        """The checkpoint this fit resumed from (None for a fresh start)."""
        self._resume_from: Path | None = None  # the FleetCheckpoint step this fit continues (given or found)
        self._reshard: Path | None = None
        self.plan: Plan | None = None
        """The plan being trained (set at setup)."""
        self.estimate: Estimate | None = None
        """The cost model's prediction for :attr:`plan`."""
        self.model_spec: ModelSpec | None = None
        """The profiled module."""
        self.cluster: ClusterSpec | None = None
        """The cluster planned for (measured or given)."""
        self.startup_s: dict[str, float] = {}
        """Seconds spent profiling, reading/measuring the cluster and planning (incl. broadcast) at setup."""
        self.micro_batch_size = micro_batch_size
        self.resume = resume
        self.progress = progress
        self.hand_back = hand_back
        self.profile: Profile | None = None
        """How the module was measured (method, fallbacks, what it means for the plan)."""
        self._facts: dict[str, Any] | None = None
        self._restorers: list[Any] = []
        self._data: TrainingData | None = None  # the user's training data, as the strategy re-batches it
        self._engine: Any = None  # the DeepSpeed engine of the last fit (kept for saving after evaluation)
        self._module_record: Any = None  # what restore_module needs to hand the user's module back
        self._training_precision: Any = None  # DeepSpeed's precision plugin while an evaluation uses a plain one

    # --- Lightning's CUDA-only seams, lifted on CPU ---------------------------------------------

    def _configure_launcher(self) -> None:
        """Under torchrun the launcher decides the world: devices and nodes come from it, not from the Trainer flags.

        Lightning's TorchElasticEnvironment rejects devices * num_nodes != WORLD_SIZE, which breaks
        ``--nnodes=MIN:MAX`` jobs whose size changes between restarts.
        """
        env = self.cluster_environment
        if env is not None and env.creates_processes_externally and "LOCAL_WORLD_SIZE" in os.environ and "WORLD_SIZE" in os.environ:
            local, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
            if world % local:
                raise FleetError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}: launch the same number of processes per node")
            first = self.parallel_devices[0] if self.parallel_devices else torch.device("cpu")
            self.parallel_devices = [torch.device("cuda", i) if first.type == "cuda" else first for i in range(local)]
            self.num_nodes = world // local
        super()._configure_launcher()

    def setup_environment(self) -> None:
        """DeepSpeedStrategy refuses non-CUDA accelerators; on CPU take the DDP path (gloo)."""
        if self.root_device.type == "cuda":
            super().setup_environment()
        else:
            DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        """DeepSpeed's device-index check rejects CPU devices (index None); skip it there."""
        if self.root_device.type == "cuda":
            return super().setup_distributed()
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _init_deepspeed_distributed(self) -> None:
        """Under plain torchrun, open the process group on a store prefix of this attempt's own, so a restart never reads
        a dead attempt's addresses (lightning_fleet.elastic.worker); DeepSpeed adopts the group. Then put the one-line
        FleetError hook back outside the one ``init_process_group`` installs (it would swallow the line); say what only
        the launch command can fix (an elastic plain-torchrun job)."""
        device = self.root_device if self.root_device.type == "cuda" else None
        open_process_group(self._get_process_group_backend(), self.global_rank, self.world_size, self._timeout, device_id=device)
        with noise.without_banner():
            super()._init_deepspeed_distributed()
        install_error_hook()
        announce_launch_advice(self.global_rank)

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):  # type: ignore[no-untyped-def]
        """deepspeed.initialize with the local rank as device rank (Lightning passes None on CPU)."""
        import argparse

        import deepspeed

        self._module_record = record_module(model)  # before DeepSpeed changes it: what restore_module hands back
        # ZeRO-3 replaces torch.nn.functional.linear for the whole process ("This will persist unless manually reset",
        # deepspeed/runtime/zero/partition_parameters.py): put back at teardown
        self._patch(torch.nn.functional, "linear", torch.nn.functional.linear)
        if self.plan is not None and self.plan.pp > 1:
            layers = find_layers(model)
            model = build_pipeline(
                model,
                pp=self.plan.pp,
                dp=self.plan.dp,
                layer_type=type(layers[0]).__name__,
                checkpoint_layers=self.plan.recompute is Recompute.FULL,
            )
            optimizer = local_optimizer(optimizer, model) if optimizer is not None else None
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank if self.root_device.index is None else self.root_device.index),
            config=self.config,
            model=model,
            model_parameters=filter(lambda p: p.requires_grad, model.parameters()),
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        check = getattr(engine, "first_dataloader_check", None)
        if check is not None:
            # DeepSpeed's one-shot TP input check compares nested batches with `!=` and crashes on
            # Lightning's (batch, batch_idx) arguments; our sampler gives every tp rank the same
            # dp slice (dp_rank = rank // tp), which the tests check instead.
            check.remove()
        self._engine = engine
        return engine, ds_optimizer

    def _init_optimizers(self) -> tuple[Any, Any]:
        """DeepSpeed drives one optimizer (and one optional scheduler): refuse more before training, in one line."""
        from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

        optimizers, schedulers = _init_optimizers_and_lr_schedulers(self.lightning_module)
        if len(optimizers) != 1 or len(schedulers) > 1:
            raise FleetError(
                f"{type(self.lightning_module).__name__}.configure_optimizers() returns {len(optimizers)} optimizers and "
                f"{len(schedulers)} schedulers; strategy 'fleet' trains through DeepSpeed, which drives exactly one optimizer and "
                "at most one scheduler: combine the parameter groups into one optimizer (or use another strategy)"
            )
        return optimizers[0], schedulers[0] if schedulers else None

    def teardown(self) -> None:
        """Undo what this strategy (and DeepSpeed: ZeRO-3's process-wide ``F.linear``) changed for training: gradient
        zeroing, recomputation wrappers; the engine stays, for ``trainer.save_checkpoint`` after fit."""
        self._undo_module_patches()
        super().teardown()

    def _patch(self, obj: Any, name: str, value: Any) -> None:
        """Set ``obj.name = value`` for this fit, remembering how to undo it."""
        had = name in vars(obj)
        self._restorers.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, value)

    def _undo_module_patches(self) -> None:
        while self._restorers:
            obj, name, had, old = self._restorers.pop()
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)

    # --- profile -> plan -> apply ---------------------------------------------------------------

    def setup(self, trainer) -> None:  # type: ignore[no-untyped-def]
        """Plan (rank 0 decides, every rank applies the same plan), then let DeepSpeed set up."""
        if trainer.state.fn == TrainerFn.FITTING:
            with deterministic_errors():  # every attempt of this job would raise them again: no restart loop
                self._facts = job_facts(self.lightning_module, global_batch_size=self.global_batch_size, data_seed=_sampler_seed())
                self._attach_checkpointing(trainer)
                if not any(isinstance(c, FleetProgress) for c in trainer.callbacks):
                    trainer.callbacks.append(FleetProgress(lines=self.progress))
                self._choose_plan(trainer)
                self._prepare_reshard()
                self._use_training_precision()
                super().setup(trainer)
        else:
            self._setup_evaluation(trainer)

    # --- validate / test / predict outside fit: whole-model replicas, no engine -------------------

    def _setup_evaluation(self, trainer) -> None:  # type: ignore[no-untyped-def]
        """validate/test/predict outside fit: every rank holds the whole model (a fit's engine in this process is
        released first, its trained weights gathered into the module) and evaluates its share of the data."""
        self._release_engine()
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._use_evaluation_precision()
        self.model = self.precision_plugin.convert_module(self.lightning_module)  # bf16-true/16-true: the module's dtype
        self.model_to_device()
        self.barrier("fleet-evaluation-setup")

    def _release_engine(self) -> None:
        """Evaluate the module itself: after a fit in this process it is already a plain module holding the trained
        weights (restored at the end of training); the engine is kept only for ``trainer.save_checkpoint``."""
        if self._engine is not None and self._module_record is not None:
            restore_module(self, self._module_record)  # a no-op when the end of training restored it already
        self.model = self.lightning_module
        self._undo_module_patches()

    @property
    def deepspeed_engine(self) -> Any:
        """The engine of the last fit (it still saves checkpoints after the module was handed back for evaluation)."""
        return self._engine if self._engine is not None else self.model

    def _engine_in_use(self) -> bool:
        return self._engine is not None and self.model is self._engine

    def on_train_end(self) -> None:
        """Hand the user's module back, as a plain module in its original structure holding the trained weights on every
        rank (collective; runs after the callbacks' on_train_end, so after the final checkpoint, and only when training
        ended normally). The engine still saves checkpoints afterwards (export.restore_module). Skipped, with one line,
        when ``hand_back=False`` or when the whole model in fp32 on every local rank would not fit the host's memory."""
        if self._engine is None or self._module_record is None or not self.hand_back:
            return
        needed = self.num_processes * sum(4 * math.prod(t.shape) for t in self._module_record.tensors if t.alias_of is None)
        available = calibrate.across_ranks(float(psutil.virtual_memory().available), self.root_device)  # the least free
        if needed > 0.8 * available:
            if self.is_global_zero:
                print(
                    f"lightning_fleet: the module is left as DeepSpeed trained it: handing its {needed / self.num_processes / GIB:.1f} GiB "
                    f"of fp32 weights back to {self.num_processes} processes per node needs {needed / GIB:.1f} GiB of host memory, "
                    f"{available / GIB:.1f} GiB is free; export the weights instead (fleet export, README 'Getting the weights out')",
                    flush=True,
                )
            return
        restore_module(self, self._module_record)

    def _use_evaluation_precision(self) -> None:
        """Without an engine, mixed precision is autocast (DeepSpeed casts the module itself during fit)."""
        from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision
        from lightning.pytorch.plugins.precision import Precision as PlainPrecision

        if self._training_precision is None:
            self._training_precision = self.precision_plugin
        name = str(self._training_precision.precision)
        if name.endswith("-mixed"):
            plugin: Any = MixedPrecision(name, self.root_device.type)  # type: ignore[arg-type]
        elif name.endswith("-true") and not name.startswith("32"):
            plugin = HalfPrecision(name)  # type: ignore[arg-type]
        else:
            plugin = PlainPrecision()
        self.precision_plugin = plugin

    def _use_training_precision(self) -> None:
        if self._training_precision is not None:
            self.precision_plugin = self._training_precision
            self._training_precision = None

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Evaluation data is split by data-parallel replica: the ranks of one tensor- or pipeline-parallel group see the
        same samples (their outputs are one model's), so logged metrics equal a single process's."""
        if self.plan is None or not self._engine_in_use():
            return {"num_replicas": self.world_size, "rank": self.global_rank}
        return {"num_replicas": self.plan.dp, "rank": self.dp_rank}

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica index under the plan (tp innermost, then dp, then pp)."""
        assert self.plan is not None
        return self.global_rank // self.plan.tp % self.plan.dp

    def _attach_checkpointing(self, trainer) -> None:  # type: ignore[no-untyped-def]
        """Add FleetCheckpoint for checkpoint_dir, and decide which checkpoint this fit continues: the ``ckpt_path`` it was
        given (a FleetCheckpoint step decides the plan and global batch as an automatic resume does; nothing is set
        aside for it), or, without one, the newest verified checkpoint of this job in the FleetCheckpoint's directory."""
        callbacks = [c for c in trainer.callbacks if isinstance(c, FleetCheckpoint)]
        if self.checkpoint_dir is not None and not callbacks:
            steps, seconds = self.checkpoint_every
            callbacks = [FleetCheckpoint(self.checkpoint_dir, every_n_steps=steps, every_n_seconds=seconds)]
            trainer.callbacks.append(callbacks[0])
        requested = _requested_checkpoint(trainer)
        if requested is not None:
            path = Path(requested)
            if (path / MANIFEST).is_file():
                self._resume_from = self._on_rank_zero(lambda: self._usable(path))
            return
        if not callbacks:
            return
        self._resume_from = self._newest_checkpoint(callbacks[0].dirpath)
        connector = trainer._checkpoint_connector
        resume_start = connector.resume_start

        def resume_from_newest(checkpoint_path=None, weights_only=None):  # type: ignore[no-untyped-def]
            # Lightning calls this right after setup with the user's ckpt_path (None when not given)
            connector.resume_start = resume_start
            return resume_start(checkpoint_path if checkpoint_path is not None else self._resume_from, weights_only)

        connector.resume_start = resume_from_newest

    def _usable(self, path: Path) -> Path:
        """The FleetCheckpoint step a fit was given, if its manifest verifies and it belongs to this job (rank 0)."""
        assert self._facts is not None
        verdict = verify(path)
        if not verdict.ok:
            raise FleetError(f"checkpoint {path} cannot be used: {verdict.reason}")
        why = incompatibility(verdict.manifest or {}, self._facts)
        if why:
            raise FleetError(f"checkpoint {path} cannot be resumed by this job: {why}")
        return path

    def _newest_checkpoint(self, directory: Path) -> Path | None:
        """Rank 0 picks the checkpoint to resume (newest verified, compatible with this job, as ``resume`` says);
        every rank gets its path, or the one-line refusal."""
        return self._on_rank_zero(lambda: self._resumable(directory))

    def checkpoint_facts(self) -> dict[str, Any]:
        """What a checkpoint of this fit records so that only a compatible job resumes it (see elastic/compatibility.py)."""
        assert self._facts is not None, "checkpoint_facts() is known from setup on"
        return self._facts

    def _resumable(self, directory: Path) -> Path | None:
        """The newest verified checkpoint this job may resume (rank 0), setting aside what ``resume`` says to."""
        assert self._facts is not None
        if self.resume == "never":
            for old in committed(directory):
                print(f"lightning_fleet: resume='never': moved {old} to {set_aside(directory, old)}", flush=True)
            return None
        while (verdict := newest_verified(directory)) is not None:
            why = incompatibility(verdict.manifest or {}, self._facts)
            if not why:
                return verdict.path
            if self.resume == "auto":
                raise FleetError(
                    f"checkpoint {verdict.path} cannot be resumed by this job: {why}; use another checkpoint_dir, or "
                    "FleetStrategy(resume='if_compatible') to set incompatible checkpoints aside and start fresh"
                )
            print(f"lightning_fleet: {verdict.path} is not this job's ({why}); moved to {set_aside(directory, verdict.path)}", flush=True)
        return None

    def _resume_manifest(self) -> dict | None:
        return json.loads((self._resume_from / MANIFEST).read_text()) if self._resume_from is not None else None

    def _prepare_reshard(self) -> None:
        """When the newest checkpoint was written at another world size: verify it, screen its pickles, and
        convert it to the universal form every ZeRO stage 1-3 loads (once)."""
        manifest = self._resume_manifest()
        if manifest is None or manifest["world_size"] == self.world_size:
            return
        source, path = parse_plan(manifest["plan"]), self._resume_from
        assert path is not None
        if source.tp > 1 or source.pp > 1:
            raise FleetError(
                f"checkpoint {path} was written by {source} on {manifest['world_size']} processes; resharding to "
                f"{self.world_size} processes needs a data-parallel checkpoint (tp=1, pp=1): relaunch with "
                f"{manifest['world_size']} processes"
            )

        def convert() -> Path:
            _check_checkpoint(path)  # nothing is unpickled before the manifest verifies and the pickles are screened
            return make_universal(path, source.zero)

        converted = self._on_rank_zero(convert)
        assert isinstance(self.config, dict)
        self.config["checkpoint"] = {"load_universal": True}
        self._reshard = converted

    def _on_rank_zero(self, fn):  # type: ignore[no-untyped-def]
        """Run ``fn`` on rank 0 and give every rank its result, or raise its FleetError on every rank. Any other
        exception on rank 0 is raised there as it is and as a FleetError naming it on the others (none waits forever)."""
        result: Any = None
        failure: BaseException | None = None
        if self.is_global_zero:
            try:
                result = fn()
            except FleetError as err:
                result = err
            except Exception as err:  # a bug or an OS error: the other ranks must not wait for a broadcast
                failure, result = err, FleetError(f"rank 0 failed while deciding for every rank: {type(err).__name__}: {err}")
        result = self.broadcast(result)
        if failure is not None:
            raise failure
        if isinstance(result, FleetError):
            raise result
        return result

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a FleetCheckpoint directory (verified, pickles screened, RNG restored) or a plain DeepSpeed one; for
        validate/test/predict, any checkpoint of any plan as full weights (export.lightning_checkpoint) or a single file."""
        path = Path(checkpoint_path)
        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            if path.is_dir():
                return lightning_checkpoint(path)
            return self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        if not (path / MANIFEST).is_file():  # a trainer.save_checkpoint dir: no manifest, but its pickles are screened too
            self._on_rank_zero(lambda: refuse_unsafe_pickles(path))
            return super().load_checkpoint(checkpoint_path, weights_only)
        resharding = self._reshard is not None and path == self._resume_from
        if not resharding:  # a resharded checkpoint was verified and screened before its conversion
            self._on_rank_zero(lambda: _check_checkpoint(path))
        manifest = json.loads((path / MANIFEST).read_text())
        if resharding:
            state = super().load_checkpoint(self._reshard, weights_only)  # universal: any dp, any ZeRO stage >= 1
            how = f"resharded from {manifest['world_size']} to {self.world_size} processes, {manifest['plan']} -> {self.plan}"
        elif manifest["world_size"] != self.world_size or manifest["plan"] != str(self.plan):
            raise FleetError(
                f"checkpoint {path} was written by plan {manifest['plan']} on {manifest['world_size']} processes; this job runs "
                f"{self.plan} on {self.world_size}: relaunch with its world and plan"
            )
        else:
            state = super().load_checkpoint(path / "state", weights_only)
            rank_file = path / f"rank-{self.global_rank:05d}.pt"
            if rank_file.is_file():
                RngState.from_checkpoint(torch.load(rank_file, weights_only=True)).install()
            how = "same plan and world"
        self.resumed_from = path
        if self.is_global_zero:
            print(f"lightning_fleet: resumed from {path} (step {manifest['step']}; {how})", flush=True)
        return state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Evaluation loads the full weights into the module; a fit's engine loaded its shards in load_checkpoint."""
        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)
            return
        super().load_model_state_dict(checkpoint, strict)

    def _format_batch_size_and_grad_accum_config(self) -> None:
        """Micro-batch and accumulation come from the plan, not from the Trainer's flags."""
        assert isinstance(self.config, dict)
        if self.plan is None:  # Lightning may read the config before a fit planned it (e.g. tensor_init_context)
            self.config.setdefault("train_micro_batch_size_per_gpu", 1)
            self.config.setdefault("gradient_accumulation_steps", 1)

    def _choose_plan(self, trainer) -> None:  # type: ignore[no-untyped-def]
        if trainer.accumulate_grad_batches != 1:
            raise FleetError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) with strategy 'fleet': the plan chooses "
                "gradient accumulation to keep the global batch; pass FleetStrategy(global_batch_size=...) instead"
            )
        if trainer.reload_dataloaders_every_n_epochs:
            raise FleetError(
                f"Trainer(reload_dataloaders_every_n_epochs={trainer.reload_dataloaders_every_n_epochs}) with strategy 'fleet': "
                "the strategy reads the training data once at setup and keys its order by the global step; vary the data "
                "inside your Dataset (e.g. by its set_epoch) instead"
            )
        module = self.lightning_module
        self._data = inspect_training_loader(_user_training_loader(trainer))
        example = example_batch(self._data, self._data.batch_size)
        gbs = self.global_batch_size or self._data.batch_size * self.world_size
        manifest = self._resume_manifest()
        if manifest is not None:  # the optimisation continues: same global batch whatever the new world (an explicit
            gbs = manifest["global_batch_size"]  # other one made the checkpoint incompatible: elastic/compatibility.py)
        precision = _precision_of(trainer)
        started = time.perf_counter()
        self.profile = profile(module, example, global_batch_size=gbs, precision=precision, name=type(module).__name__)
        self.model_spec = self.profile.spec
        profiled = time.perf_counter()
        self.cluster = self._resolve_cluster()
        measured = time.perf_counter()
        self.plan = parse_plan(self._on_rank_zero(self._plan_on_rank_zero))  # an error is raised on every rank
        self.startup_s = {"profile_s": profiled - started, "cluster_s": measured - profiled, "plan_s": time.perf_counter() - measured}
        self.estimate = estimate(self.model_spec, self.cluster, self.plan)
        tp = tensor_parallel_hook(module)
        self.config = deepspeed_config(
            self.plan,
            gradient_clipping=float(trainer.gradient_clip_val or 0.0),
            overlap_comm=self.root_device.type == "cuda",
            tensor_parallel=tp[1] if tp else None,
        )
        if self.plan.recompute is Recompute.FULL and self.plan.pp == 1:  # (the pipeline checkpoints its own layers)
            for layer in find_layers(module):
                self._patch(layer, "forward", _checkpointed(layer.forward))
        if module.automatic_optimization:
            # DeepSpeed zeroes gradients after every real optimizer step. Lightning's zero_grad runs after
            # training_step, i.e. after this step's first gas-1 micro-batches: it must not wipe them.
            self._patch(module, "optimizer_zero_grad", _engine_zeroes_gradients)

    def _resolve_cluster(self) -> ClusterSpec:
        shape = calibrate.WorldShape(world_size=self.world_size, num_nodes=self.num_nodes, local_world_size=self.num_processes)
        if self.cluster_source is not None:
            cluster = self.cluster_source if isinstance(self.cluster_source, ClusterSpec) else load_cluster(self.cluster_source)
            if cluster.world_size != self.world_size:
                raise FleetError(
                    f"cluster {cluster.name!r} has {cluster.world_size} devices ({cluster.num_nodes} nodes x "
                    f"{cluster.devices_per_node}) but this job runs {self.world_size} processes ({self.num_nodes} nodes x "
                    f"{self.num_processes}): fix the cluster file or drop cluster= to measure this machine"
                )
            return cluster
        path = calibrate.cache_path(self.root_device, shape)
        cached = calibrate.load_cached(path) if self.is_global_zero else None
        cached = self.broadcast(cached)
        if cached is not None:
            return cached
        measured = calibrate.measure_cluster(self.root_device, shape)
        measured = self.broadcast(measured)  # every rank plans with rank 0's numbers
        if self.is_global_zero:
            calibrate.save_cache(measured, path)
        return measured

    def _constraints(self):  # type: ignore[no-untyped-def]
        module = self.lightning_module
        manifest = self._resume_manifest()
        if manifest is not None and manifest["world_size"] != self.world_size:
            # resharding goes through a universal checkpoint: data parallel with ZeRO 1-3 partitions
            stages = tuple(z for z in self.zero_stages if z >= 1)
            if not stages:
                raise FleetError(
                    f"checkpoint {self._resume_from} must be resharded to {self.world_size} processes, which needs ZeRO stage "
                    f"1, 2 or 3, but FleetStrategy(zero_stages={self.zero_stages}): allow one of them"
                )
            return runtime_constraints(
                has_tensor_parallel=False,
                has_pipeline=False,
                has_layers=find_layers(module) is not None,
                allow_offload=self.allow_offload,
                require_offload=self.require_offload,
                zero_stages=stages,
            )
        return runtime_constraints(
            has_tensor_parallel=tensor_parallel_hook(module) is not None,
            # a pipeline runs forward, backward and step itself: not with the user's own optimization loop
            has_pipeline=pipeline_hook(module) is not None and find_layers(module) is not None and module.automatic_optimization,
            has_layers=find_layers(module) is not None,
            allow_offload=self.allow_offload,
            require_offload=self.require_offload,
            max_tp=self.max_tp,
            max_pp=self.max_pp,
            zero_stages=self.zero_stages,
        )

    def _plan_on_rank_zero(self) -> str:
        """The plan string (rank 0 only: it prints the table)."""
        assert self.model_spec is not None and self.cluster is not None
        spec, cluster, manifest = self.model_spec, self.cluster, self._resume_manifest()
        partial, notes = self._fixed_axes()
        if manifest is not None and manifest["world_size"] == self.world_size:  # same world: continue exactly
            resumed = parse_plan(manifest["plan"], global_batch_size=spec.global_batch_size)
            clash = {k: v for k, v in partial.fixed.items() if getattr(resumed, k) != v}
            if clash:
                raise FleetError(
                    f"checkpoint {self._resume_from} was trained with plan {resumed}, but this job fixes "
                    f"{', '.join(f'{k}={field_text(v)}' for k, v in clash.items())}: drop those from plan=/micro_batch_size= to "
                    "continue it, or start in another checkpoint_dir"
                )
            self._check_resumable_plan(resumed)
            _print_table(estimate(spec, cluster, resumed), None, cluster, [*notes, f"resumed  {self._resume_from}: its plan continues"])
            return str(resumed)
        constraints = self._constraints()
        _check_runtime_supports(partial, constraints, self.lightning_module)
        constraints = narrow(constraints, partial)
        if partial.complete:  # everything fixed: train it as given (priced, not searched)
            forced = partial.to_plan(spec.global_batch_size)
            _print_table(estimate(spec, cluster, forced), None, cluster, notes + _pipeline_note(forced))
            return str(forced)
        result = search_plans(spec, cluster, top=self.top, constraints=constraints)
        _print_table(result.best, result, cluster, notes + _pipeline_note(result.best.plan))
        return str(result.best.plan)

    def _check_resumable_plan(self, resumed: Plan) -> None:
        """The checkpoint's plan must be one this job may run (its zero_stages, offload settings, limits and hooks)."""
        whole = parse_partial_plan(str(resumed))
        try:
            constraints = self._constraints()
            _check_runtime_supports(whole, constraints, self.lightning_module)
            narrow(constraints, whole)
        except FleetError as err:
            raise FleetError(
                f"checkpoint {self._resume_from} was trained with plan {resumed}, which this job may not run ({err}): allow it "
                "(FleetStrategy's zero_stages, offload, max_tp/max_pp, the module's hooks) or start in another checkpoint_dir"
            ) from None

    def _fixed_axes(self) -> tuple[PartialPlan, list[str]]:
        """What the planner may not choose (the user's plan and micro_batch_size, what the loss and the optimization
        loop need) and the report lines that say why."""
        partial = parse_partial_plan(self.forced_plan or "")
        notes = self._profile_lines()
        if partial.fixed:
            rest = "" if partial.complete else "; the planner chose the rest"
            notes.append(f"fixed    {partial} (FleetStrategy(plan=...)){rest}")
        module, profiled = self.lightning_module, self.profile
        if self.micro_batch_size is not None:
            partial = partial.fix(mbs=self.micro_batch_size)
            notes.append(f"fixed    mbs={self.micro_batch_size} (FleetStrategy(micro_batch_size=...))")
        elif profiled is not None and profiled.batch_dependent and partial.mbs is None and self._data is not None:
            mbs, gbs = self._data.batch_size, self.model_spec.global_batch_size
            if gbs % mbs == 0:
                partial = partial.fix(mbs=mbs)
                notes.append(
                    f"fixed    mbs={mbs}: the loss depends on the micro-batch (BatchNorm, in-batch negatives or a summed loss), "
                    "so the DataLoader's batch size stays the micro-batch; pass micro_batch_size=N to choose another"
                )
            else:
                notes.append(
                    f"note     the loss depends on the micro-batch, but the DataLoader's batch size {mbs} does not divide the "
                    f"global batch {gbs}: the planner chooses it; pass micro_batch_size=N to pin one"
                )
        elif profiled is not None and profiled.batch_dependent is None and partial.mbs is None:
            notes.append("note     whether the loss depends on the micro-batch is unknown; pass micro_batch_size=N to pin it")
        if not module.automatic_optimization:
            if partial.gas not in (None, 1):
                raise FleetError(f"plan {partial}: {type(module).__name__} steps its own optimizer once per training_step, so gas must be 1")
            partial = partial.fix(gas=1)
            notes.append("fixed    gas=1, no pipeline: manual optimization steps once per training_step")
        return partial, notes

    def _profile_lines(self) -> list[str]:
        return self.profile.report_lines() if self.profile is not None else []

    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")

    # --- the training data: global-batch order, micro-batches per step --------------------------

    def process_dataloader(self, dataloader: object) -> object:
        """Re-batch the training data into this rank's step batches of ``gas`` micro-batches of ``mbs`` (see data.py)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.plan is None or self._data is None or trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        plan = self.plan
        with deterministic_errors():  # e.g. fewer samples than one global batch: every attempt would say so again
            return step_loader(
                self._data,
                global_batch_size=plan.global_batch_size,
                dp_size=plan.dp,
                dp_rank=self.dp_rank,
                gas=plan.gas,
                seed=_sampler_seed(),
                first_step=lambda: trainer.global_step,
            )

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the step's micro-batches: all but the last through DeepSpeed here, the last through Lightning's loop."""
        batch, *rest = args
        if not isinstance(batch, MicroBatches):
            return super().training_step(*args, **kwargs)
        if self.plan is not None and self.plan.pp > 1:
            return self._pipeline_step(batch)
        if not self.lightning_module.automatic_optimization:  # the plan has one micro-batch; the user steps
            return super().training_step(batch[0], *rest, **kwargs)
        engine = self.deepspeed_engine
        losses = []
        for micro in batch[:-1]:
            loss = _loss_of(super().training_step(micro, *rest, **kwargs))
            engine.backward(loss)
            engine.step()  # DeepSpeed counts the micro-step; it updates only at the accumulation boundary
            losses.append(loss.detach())
        output = super().training_step(batch[-1], *rest, **kwargs)
        last = _loss_of(output)
        mean = torch.stack([*losses, last.detach()]).mean()
        # the progress bar shows the step's mean loss; the gradient is still the last micro-batch's
        shown = last + (mean - last.detach())
        return {**output, "loss": shown} if isinstance(output, Mapping) else shown

    def _pipeline_step(self, batch: MicroBatches) -> torch.Tensor:
        """One optimizer step through DeepSpeed's pipeline schedule (forward, backward and step of every micro-batch);
        Lightning's automatic loop only counts it, steps the schedulers and logs."""
        loss = self.deepspeed_engine.train_batch(micro_batch_iterator(batch))
        self.lightning_module.log("train_loss", loss, prog_bar=True)
        return loss

    def _pipelined(self) -> bool:
        return self._engine_in_use() and self.plan is not None and self.plan.pp > 1

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Under a pipeline the engine ran backward inside train_batch already."""
        if self._pipelined():
            return closure_loss
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Under a pipeline the closure runs the step's train_batch, which also stepped the engine."""
        if self._pipelined():
            return closure()
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def on_validation_start(self) -> None:
        """Under a pipeline each rank's engine trains only its stage: bring every stage's current weights into the module
        so that the user's own validation_step runs on the whole model."""
        if self._pipelined():
            sync_stage_weights(self._engine, self.lightning_module)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's validation_step; under a pipeline on the module itself (its stages synchronised at validation start)."""
        if not self._pipelined():
            return super().validation_step(*args, **kwargs)
        with self.precision_plugin.val_step_context():
            return self.lightning_module.validation_step(*args, **kwargs)

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        """DeepSpeed's sharded checkpoint, with the plan and global batch recorded for resume, and the layout
        (``fleet_layout.json``, rank 0) that lets :func:`lightning_fleet.export.export_state_dict` rebuild the full weights."""
        if self.plan is not None:
            checkpoint["fleet"] = {"plan": str(self.plan), "global_batch_size": self.plan.global_batch_size, "world_size": self.world_size}
        super().save_checkpoint(checkpoint, filepath, storage_options)
        write_layout(self, filepath, self._module_record)  # every rank (collective for ZeRO-0 fp16/bf16 masters); rank 0 writes
        self.barrier("fleet-layout-written")  # the checkpoint is whole on every rank when save_checkpoint returns

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``fleet`` (plan everything), ``fleet_zero3`` (ZeRO-3 only), ``fleet_offload`` (offload required)."""
        for name, (description, init_params) in PRESETS.items():
            strategy_registry.register(name, cls, description=description, override=True, **init_params)


# --- small helpers (module level: no strategy state) ------------------------------------------------


def _user_training_loader(trainer) -> Any:  # type: ignore[no-untyped-def]
    """The training DataLoader as the user returns it (Lightning's re-instantiated one hides its sampler and shuffle)."""
    source = trainer.fit_loop._data_source
    if not source.is_defined():
        raise FleetError("strategy 'fleet' needs a training DataLoader to size the global batch and profile the model")
    return source.dataloader()


def _requested_checkpoint(trainer) -> Any:  # type: ignore[no-untyped-def]
    """The ``ckpt_path`` this fit was given (resolved: "last", "hpc" are paths by now), or None.

    Lightning 2.6 passes it as an argument of ``Trainer._run`` straight to ``_restore_modules_and_callbacks`` after the
    strategy's setup, and keeps it nowhere the setup can read; it is read from that call's frame.
    """
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "_run" and frame.f_locals.get("self") is trainer:
            return frame.f_locals.get("ckpt_path")
        frame = frame.f_back
    return None


def _precision_of(trainer) -> Precision:  # type: ignore[no-untyped-def]
    name = str(trainer.precision)
    if name not in _PRECISIONS:
        raise FleetError(f"strategy 'fleet' supports precision 32-true, bf16-mixed, bf16-true, 16-mixed; got {name!r}")
    return _PRECISIONS[name]


def _sampler_seed() -> int:
    """The global seed Lightning's seed_everything set (0 without one), identical on every rank."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def _loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, Mapping):
        return output["loss"]
    if not isinstance(output, torch.Tensor):
        raise deterministic(FleetError(
            f"training_step returned {type(output).__name__}; with several micro-batches per step (gas > 1) strategy 'fleet' "
            "needs the loss tensor or a dict with 'loss' from every micro-batch"
        ))
    return output


def _check_runtime_supports(plan: PartialPlan, constraints: Any, module: Any) -> None:
    """The axes a user fixed must be something this runtime executes for this module; say what is missing otherwise
    (what else the runtime cannot run, PartialPlan.constraints names)."""
    module_name = type(module).__name__
    if (plan.tp or 1) > 1 and constraints.max_tp == 1:
        raise FleetError(f"plan {plan} has tp={plan.tp}, but {module_name} defines no fleet_tensor_parallel() hook: add it or use tp=1")
    if (plan.pp or 1) > 1 and constraints.max_pp == 1:
        raise FleetError(f"plan {plan} has pp={plan.pp}, but {module_name} {_no_pipeline_because(module)}")
    if (plan.pp or 1) > 1 and ((plan.tp or 1) > 1 or plan.offload not in (None, Offload.NONE) or (plan.zero or 0) > 1):
        raise FleetError(f"plan {plan}: DeepSpeed's pipeline engine runs with zero <= 1, without tp and without offload")
    if plan.sp or (plan.vpp or 1) > 1:
        raise FleetError(f"plan {plan}: DeepSpeed runs neither sequence parallelism nor interleaved pipelines; use sp=false, vpp=1")
    if plan.recompute is Recompute.SELECTIVE:
        raise FleetError(f"plan {plan}: selective recomputation needs attention internals; use recompute=full or none")
    if plan.recompute is Recompute.FULL and Recompute.FULL not in constraints.recompute:
        raise FleetError(f"plan {plan}: recompute=full needs the layer stack: add fleet_layers() to {module_name}")
    if plan.zero is not None and plan.zero not in constraints.zero_stages:
        raise FleetError(f"plan {plan}: zero={plan.zero} is outside zero_stages={constraints.zero_stages}")
    if plan.offload not in (None, Offload.NONE) and not constraints.allow_offload:
        raise FleetError(f"plan {plan} offloads, but allow_offload=False")


def _pipeline_note(plan: Plan) -> list[str]:
    """What a pipeline plan changes for the user's code (said in the start-up report)."""
    if plan.pp == 1:
        return []
    return [
        "note     pipeline: each step runs fleet_pipeline()'s layers and loss_fn, not training_step (its logging and "
        "metrics do not run; the step's loss is logged as train_loss); validation runs your validation_step"
    ]


def _no_pipeline_because(module: Any) -> str:
    if not module.automatic_optimization:
        return "optimizes manually, and a pipeline runs forward, backward and step itself: use pp=1"
    return "defines no fleet_pipeline() (and fleet_layers()) hook: add it or use pp=1"


def _check_checkpoint(path: Path) -> None:
    """Raise FleetError unless the checkpoint's manifest verifies and its pickles import only allowed globals."""
    verdict = verify(path)
    if not verdict.ok:
        raise FleetError(f"checkpoint {path} cannot be used: {verdict.reason}")
    refuse_unsafe_pickles(path)


def _engine_zeroes_gradients(*args: Any, **kwargs: Any) -> None:
    """Stands in for LightningModule.optimizer_zero_grad under strategy 'fleet' (DeepSpeed zeroes after each step)."""


def _checkpointed(forward: Any) -> Any:
    """Full recomputation: a layer's forward under torch.utils.checkpoint (non-reentrant)."""
    from torch.utils.checkpoint import checkpoint

    return lambda *args, **kwargs: checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _print_table(chosen: Estimate, result: PlanResult | None, cluster: ClusterSpec, notes: list[str]) -> None:
    """Rank 0's start-up report: how the module was measured and what was fixed, the plan, its predicted memory and
    time, and why the runners-up lost."""
    lines = [
        f"lightning_fleet plan for {chosen.model.name} ({chosen.model.params / 1e6:.2f} M params, global batch "
        f"{chosen.plan.global_batch_size}) on {cluster.name} ({cluster.world_size} x {cluster.groups[0].device.name}):",
        *(f"  {note}" for note in notes),
        f"  chosen   {chosen.plan}",
        f"           predicted {chosen.time.step_s:.4g} s/step, {chosen.memory.total_bytes / GIB:.2f} of "
        f"{chosen.memory.limit_bytes / GIB:.2f} GiB per device ({chosen.time.largest_term()[0]} dominates)",
    ]
    if result is not None:
        lines.append(f"  searched {result.candidates} candidates, {result.feasible} fit, in {result.seconds:.3f} s")
        for runner in result.plans[1:]:
            lines.append(f"  runner-up {runner.plan}: {runner.time.step_s:.4g} s/step ({runner.time.step_s / chosen.time.step_s:.2f}x)")
        for rejection in [r for r in result.rejected if not r.reason.startswith("slower")][:2]:
            lines.append(f"  misfit   {rejection.plan}: {rejection.reason}")
    print("\n".join(lines), flush=True)
