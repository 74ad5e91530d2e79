"""FleetStrategy: the Lightning faces of the neutral fit core (:mod:`lightning_fleet.fit`).

:class:`~lightning_fleet.fit.FitCore` holds everything one fit does that is neither Lightning's nor a runtime's (setup ->
Decision, apply, the engine, step batches, loss weights, rebalancing, save, the load route, the hand-back); the classes
here only translate Lightning's hooks into its calls. Three classes: :class:`FleetStrategy` (on Lightning's
DDPStrategy) holds what every face shares -- the options a user passes, Lightning's process-group and launcher seams
lifted on CPU, the callbacks a fit attaches, evaluation outside fit on whole-module replicas, the training step's
micro-batch loop -- and one thin face per runtime, on the Lightning class whose precision plugin it needs:
:class:`DeepSpeedFleetStrategy` (DeepSpeedStrategy, its CUDA-only seams lifted on CPU) and :class:`TorchFleetStrategy`
(DDPStrategy). ``FleetStrategy(...)`` becomes the face of the runtime asked for, and at setup the face of the runtime
the decision chose (the runtime table names each runtime's face, :data:`lightning_fleet.runtime.RUNTIMES`). Imported by
the package's ``__init__`` and the presets' registration; nothing below it imports it (tests/test_layering.py).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping

from lightning_fleet import noise

noise.install()  # before DeepSpeed is first imported: its accelerator banner comes at import time

import torch  # noqa: E402
from lightning.fabric.utilities.seed import reset_seed  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy  # noqa: E402
from lightning.pytorch.trainer.states import RunningStage, TrainerFn  # noqa: E402

from lightning_fleet.calibrate.measure import WorldShape  # noqa: E402
from lightning_fleet.decide import Decision, JobOptions  # noqa: E402
from lightning_fleet.elastic.callback import FleetCheckpoint, NonFiniteGuard  # noqa: E402
from lightning_fleet.elastic.compatibility import JobFacts  # noqa: E402
from lightning_fleet.elastic.layout import KIND_LIGHTNING  # noqa: E402
from lightning_fleet.elastic.safe_load import load_file  # noqa: E402
from lightning_fleet.elastic.sampler import MicroBatches  # noqa: E402
from lightning_fleet.elastic.worker import (  # noqa: E402
    announce_launch_advice,
    collectives,
    deterministic,
    deterministic_errors,
    destroy_groups_at_exit,
    die_with_agent,
    install_error_hook,
    open_process_group,
    strict_sigterm_broadcast,
)
from lightning_fleet.export import lightning_checkpoint  # noqa: E402
from lightning_fleet.fit import FitCore, FitSettings, check_batch_sizes  # noqa: E402
from lightning_fleet.planning import ClusterSpec, Estimate, FleetError, ModelSpec, Plan, PlanError  # noqa: E402
from lightning_fleet.planning.plan import parse_partial_plan  # noqa: E402
from lightning_fleet.profiling import Profile  # noqa: E402
from lightning_fleet.progress import FleetProgress  # noqa: E402
from lightning_fleet.runtime import AUTO, RUNTIME_NAMES, RUNTIMES, Runtime, runtime_named  # noqa: E402
from lightning_fleet.strategy_names import PRESETS  # noqa: E402


class FleetStrategy(DDPStrategy):
    """Chooses the parallel layout (ZeRO stage, offload, tp, micro-batch, accumulation, recomputation) and trains it.

    ``Trainer(strategy="fleet")`` after ``import lightning_fleet``; or ``FleetStrategy(...)`` with:

    Args:
        runtime: what executes the plan: ``"auto"`` (the default: the planner prices each installed runtime's best plan
            and trains the fastest; a tie goes to the first in :data:`lightning_fleet.runtime.RUNTIMES`), ``"torch"``
            (torch's own stack: DistributedDataParallel, FSDP2, DTensor tensor parallelism) or ``"deepspeed"``.
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
        rebalance_every_n_steps: every N optimizer steps every rank probes its sustained speed (about
            ``calibrate.measure.RANK_PROBE_S``, in rounds: a rank counts as slower only where it is slower in each round,
            ``calibrate.ranks``); when the speeds have drifted so that another split of each step's
            samples over the data-parallel replicas is predicted at least ``planning.search.REBALANCE_GAIN`` faster, the replicas' micro-batch
            sizes (``dp_mbs``) change from a later step on (back to the even split once the ranks measure alike again): the same samples form each step and the gradient stays the
            global batch's mean, so the optimisation does not change. Only for a data-parallel plan (pp=1) of a module
            whose loss is known not to depend on the micro-batch, under automatic optimization. None (the default):
            every 100 steps, and never so often that the probes take more than REBALANCE_OVERHEAD of the time trained;
            0: never.
        non_finite: what a step whose loss is NaN or infinite on any rank does (checked on every rank before the
            optimizer applies it, agreed with one small all-reduce): ``"stop"`` (the default) ends the job in one line
            naming the step and the last good checkpoint; ``"skip"`` leaves that step unapplied (weights and optimizer
            state unchanged), with a line for it and the count at the end of fit. Either way non-finite weights are
            never saved (FleetCheckpoint checks every rank's shard before each commit).
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
        rebalance_every_n_steps: int | None = None,
        non_finite: str = "stop",
        runtime: str = AUTO,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
    ) -> None:
        install_error_hook()  # an uncaught FleetError is one line per job (and, when deterministic, no restart loop)
        self._take_face(_fixed_runtime(plan) if runtime == AUTO else runtime)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        check_batch_sizes(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size)
        settings = FitSettings(
            cluster=cluster,
            checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir is not None else None,
            checkpoint_every_n_steps=checkpoint_every_n_steps,
            checkpoint_every_n_seconds=checkpoint_every_n_seconds,
            resume=resume,
            progress=progress,
            hand_back=hand_back,
            rebalance_every_n_steps=rebalance_every_n_steps,
            non_finite=non_finite,
        )
        options = JobOptions(
            plan=plan,
            micro_batch_size=micro_batch_size,
            global_batch_size=global_batch_size,
            allow_offload=allow_offload or require_offload,
            require_offload=require_offload,
            max_tp=max_tp,
            max_pp=max_pp,
            zero_stages=tuple(zero_stages),
            top=top,
        )
        asked = runtime if runtime == AUTO else _installed_runtime(runtime).name
        self.core = FitCore(self, options, settings, asked, _face_runtime(type(self)).load_backend())
        """The neutral fit core (lightning_fleet/fit.py) this face delegates to."""

    def _take_face(self, runtime: str) -> None:
        """Become the Lightning face of the runtime asked for, before Lightning's own __init__ runs: Lightning chooses
        the precision plugin (and a few callbacks' behaviour) by the strategy's class when the Trainer is built, before
        any plan exists. Under ``runtime="auto"`` it is DeepSpeed's face when DeepSpeed is installed (its Lightning class
        holds every attribute the torch face's does: DeepSpeedStrategy derives from DDPStrategy), and :meth:`_become`
        turns it into the chosen runtime's face at setup. A face (or a subclass of one) stays what it is."""
        if _runtime_of_class(type(self)) is not None:
            return
        if runtime == AUTO:
            installed = [r for r in RUNTIMES if r.installed()]
            chosen = next((r for r in installed if r.name == "deepspeed"), installed[0] if installed else RUNTIMES[0])
        else:
            chosen = _installed_runtime(runtime)
        self.__class__ = _with_face(type(self), chosen)

    # --- what was decided (the core's, read here) -----------------------------------------------------

    @property
    def options(self) -> JobOptions:
        """What the planner was asked (see :class:`lightning_fleet.decide.JobOptions`)."""
        return self.core.options

    @property
    def settings(self) -> FitSettings:
        """The rest of what the user set (see :class:`lightning_fleet.fit.FitSettings`)."""
        return self.core.settings

    @property
    def runtime(self) -> str:
        """The runtime asked for: a name, or "auto" (the decision's ``runtime`` says which one trains)."""
        return self.core.runtime

    @property
    def backend(self) -> Any:
        """The runtime that applies the decision (the face's; the chosen runtime's from setup on)."""
        return self.core.backend

    @property
    def decision(self) -> Decision | None:
        """What this fit decided at setup (plan, estimate, cluster, resume)."""
        return self.core.decision

    @property
    def plan(self) -> Plan | None:
        """The plan being trained (set at setup)."""
        return self.core.plan

    @property
    def estimate(self) -> Estimate | None:
        """The cost model's prediction for :attr:`plan`."""
        return self.decision.estimate if self.decision is not None else None

    @property
    def model_spec(self) -> ModelSpec | None:
        """The profiled module."""
        return self.decision.model if self.decision is not None else None

    @property
    def cluster(self) -> ClusterSpec | None:
        """The cluster planned for (measured or given)."""
        return self.decision.cluster if self.decision is not None else None

    @property
    def profile(self) -> Profile | None:
        """How the module was measured (method, fallbacks, what it means for the plan)."""
        return self.core.profile

    @property
    def startup_s(self) -> dict[str, float]:
        """Seconds spent at setup reading/measuring the cluster, choosing (verifying) the checkpoint to continue,
        profiling, and deciding (incl. broadcasts)."""
        return self.core.startup_s

    @property
    def resumed_from(self) -> Path | None:
        """The checkpoint this fit resumed from (None for a fresh start)."""
        return self.core.resumed_from

    @property
    def rebalances(self) -> tuple[str, ...]:
        """What each rebalance of the last fit did (the lines rank 0 printed): the ranks' speeds, the step it was decided
        at, the new micro-batch sizes and the step they start at."""
        return tuple(self.core.rebalanced)

    def checkpoint_facts(self) -> JobFacts:
        """What a checkpoint of this fit records so that only a compatible job resumes it (see elastic/compatibility.py)."""
        assert self.core.facts is not None, "checkpoint_facts() is known from setup on"
        return self.core.facts

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

    def setup_distributed(self) -> None:
        """Seeds, ranks, and the process group (:meth:`_open_process_group`)."""
        reset_seed()
        self.set_world_ranks()
        self._open_process_group()

    def _open_process_group(self) -> None:
        """Under plain torchrun, open the process group on a store prefix of this attempt's own, so a restart never reads
        a dead attempt's addresses (lightning_fleet.elastic.worker); the runtime adopts the group
        (:meth:`_adopt_process_group`). Then put the one-line FleetError hook back outside the one
        ``init_process_group`` installs (it would swallow the line); say what only the launch command can fix (an
        elastic plain-torchrun job). Every step of this fit is supervised (:meth:`_supervise`)."""
        self._supervise()
        device = self.root_device if self.root_device.type == "cuda" else None
        open_process_group(self._get_process_group_backend(), self.global_rank, self.world_size, self._timeout, device_id=device)
        destroy_groups_at_exit()
        self._adopt_process_group()
        install_error_hook()
        announce_launch_advice(self.global_rank)

    def _adopt_process_group(self) -> None:
        """The default group for the runtime: torch uses the one opened on the agent's store as it is, or (Lightning's
        own launcher, a store of its own per attempt) opens it as Lightning's DDP does."""
        from lightning.fabric.utilities.distributed import _init_dist_connection

        self._process_group_backend = self._get_process_group_backend()
        device = self.root_device if self.root_device.type != "cpu" else None
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device)

    def _supervise(self) -> None:
        """For this fit (undone at teardown): every process group torch or DeepSpeed creates gets ``timeout`` (torch's
        ``new_group`` takes its default, 30 min for gloo, from distributed_c10d's ``default_pg_timeout``, and DeepSpeed's
        groups pass none), and Lightning's per-step SIGTERM broadcast raises when a peer hung past it instead of
        swallowing the timeout. Under torchrun the worker dies with its agent (lightning_fleet.elastic.worker)."""
        from torch.distributed import distributed_c10d

        if self._timeout is not None:
            for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
                self.core.patch(distributed_c10d, name, self._timeout)
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        loop = trainer.fit_loop.epoch_loop if trainer is not None else None
        broadcast = strict_sigterm_broadcast(loop, self._timeout) if loop is not None else None
        if broadcast is not None:
            self.core.patch(loop, "_broadcast_sigterm_tensor", broadcast)
        die_with_agent()

    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")

    # --- setup: the core decides once and applies; the face follows -----------------------------------

    def setup(self, trainer) -> None:  # type: ignore[no-untyped-def]
        """fit: the core decides (rank 0 decides, every rank reads the same Decision), this face becomes the chosen
        runtime's, the core applies the decision, Lightning's own setup builds the engine through the face's seam;
        validate/test/predict: whole-module replicas."""
        if trainer.state.fn != TrainerFn.FITTING:
            self._setup_evaluation(trainer)
            return
        with deterministic_errors():  # every attempt of this job would raise them again: no restart loop
            _check_trainer_flags(trainer)
            core = self.core
            seed = self.broadcast(_sampler_seed())  # rank 0's: ranks seeded apart (seed + rank) still read one order
            core.begin(self.lightning_module, _user_training_loader(trainer), data_seed=seed)
            directory = self._attach_callbacks(trainer)
            shape = WorldShape(world_size=self.world_size, num_nodes=self.num_nodes, local_world_size=self.num_processes)
            decision = core.decide(requested=_requested_checkpoint(trainer), directory=directory,
                                   precision=str(trainer.precision), shape=shape)
            self._become(decision.runtime)
            self._apply(trainer)
            self._use_training_precision()
            super().setup(trainer)

    def _attach_callbacks(self, trainer) -> Path | None:  # type: ignore[no-untyped-def]
        """FleetProgress, NonFiniteGuard, and FleetCheckpoint for checkpoint_dir, which claims its directory (lock, probe)
        before anything reads it; the directory whose newest checkpoint a fit without ``ckpt_path`` continues (None: no
        FleetCheckpoint). Lightning's resume is pointed at the decided checkpoint."""
        settings = self.settings
        if not any(isinstance(c, FleetProgress) for c in trainer.callbacks):
            trainer.callbacks.append(FleetProgress(lines=settings.progress))
        if not any(isinstance(c, NonFiniteGuard) for c in trainer.callbacks):
            trainer.callbacks.insert(0, NonFiniteGuard(settings.non_finite))  # a step's verdict before any callback saves it
        callbacks = [c for c in trainer.callbacks if isinstance(c, FleetCheckpoint)]
        if settings.checkpoint_dir is not None and not callbacks:
            callbacks = [FleetCheckpoint(settings.checkpoint_dir, every_n_steps=settings.checkpoint_every_n_steps,
                                         every_n_seconds=settings.checkpoint_every_n_seconds)]
            trainer.callbacks.append(callbacks[0])
        if not callbacks:
            return None
        callbacks[0].claim(trainer)
        connector = trainer._checkpoint_connector
        resume_start = connector.resume_start

        def resume_from_decided(checkpoint_path=None, weights_only=None):  # type: ignore[no-untyped-def]
            # Lightning calls this right after setup with the user's ckpt_path (None when not given)
            connector.resume_start = resume_start
            decided = self.decision.resume.path if self.decision is not None else None
            return resume_start(checkpoint_path if checkpoint_path is not None else decided, weights_only)

        connector.resume_start = resume_from_decided
        return callbacks[0].dirpath

    def _become(self, name: str) -> None:
        """Turn into the face of the runtime the decision chose (the same object: the Trainer holds it): its class, the
        core's backend, and the precision plugin Lightning would have built for that class."""
        runtime = runtime_named(name)
        self.core.use(runtime)
        if _runtime_of_class(type(self)) is runtime:
            return
        self.__class__ = _with_face(type(self), runtime)
        self.precision_plugin = _autocast_precision(str(self.precision_plugin.precision), self.root_device.type)

    def _apply(self, trainer) -> None:  # type: ignore[no-untyped-def]
        """The core applies the decision (the runtime's configuration, a resharded checkpoint's conversion, the module
        changes for this fit); returns nothing: a face that reads the configuration overrides this."""
        self.core.apply(gradient_clipping=float(trainer.gradient_clip_val or 0.0), precision_plugin=self.precision_plugin)

    def _build_engine(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
        """The runtime's engine over the module (the core records the module first: what the end of fit hands back)."""
        device_rank = self.local_rank if self.root_device.index is None else self.root_device.index
        return self.core.build_engine(model, optimizer, lr_scheduler, device_rank=device_rank)

    def teardown(self) -> None:
        """Undo what this fit changed for training (gradient zeroing, recomputation wrappers, the runtime's process-wide
        replacements such as ZeRO-3's ``F.linear``); the engine stays, for ``trainer.save_checkpoint`` after fit."""
        self.core.undo_patches()
        super().teardown()

    # --- validate / test / predict outside fit: whole-model replicas, no engine -------------------

    def _setup_evaluation(self, trainer) -> None:  # type: ignore[no-untyped-def]
        """validate/test/predict outside fit: every rank holds the whole model (a fit's engine in this process is
        released first, its trained weights gathered into the module) and evaluates its share of the data."""
        self.core.release_engine(self.lightning_module)
        self.model = self.lightning_module
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._use_evaluation_precision()
        self.model = self.precision_plugin.convert_module(self.lightning_module)  # bf16-true/16-true: the module's dtype
        self.model_to_device()
        self.barrier("fleet-evaluation-setup")

    @property
    def engine(self) -> Any:
        """The runtime's engine of the last fit (it still saves checkpoints after the module was handed back for
        evaluation)."""
        return self.core.engine if self.core.engine is not None else self.model

    @property
    def gradient_check(self) -> str:
        """How NonFiniteGuard checks a step's gradient while the engine trains (:meth:`FitCore.gradient_check`)."""
        return self.core.gradient_check(self.model)

    def _engine_in_use(self) -> bool:
        """Whether the runtime's engine trains or evaluates now (not after the module was handed back)."""
        return self.core.engine_in_use(self.model)

    def on_train_end(self) -> None:
        """Hand the user's module back, as a plain module in its original structure holding the trained weights on every
        rank (collective; runs after the callbacks' on_train_end, so after the final checkpoint, and only when training
        ended normally; :meth:`FitCore.hand_back_at_end`). The engine still saves checkpoints afterwards."""
        if self.core.hand_back_at_end() and self.core.engine is not self.model:
            self.model = self.core.engine  # a runtime that let its engine go handed the module back in its place

    def _use_evaluation_precision(self) -> None:
        """Without an engine, mixed precision is autocast (DeepSpeed casts the module itself during fit)."""
        if self._training_precision is None:
            self._training_precision = self.precision_plugin
        self.precision_plugin = _autocast_precision(str(self._training_precision.precision), self.root_device.type)

    def _use_training_precision(self) -> None:
        if self._training_precision is not None:
            self.precision_plugin = self._training_precision
            self._training_precision = None

    _training_precision: Any = None
    """The runtime face's precision plugin while an evaluation uses a plain one."""

    # --- the training data: global-batch order, micro-batches per step --------------------------

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Evaluation data is split by data-parallel replica: the ranks of one tensor- or pipeline-parallel group see the
        same samples (their outputs are one model's), so logged metrics equal a single process's."""
        if self.plan is None or not self._engine_in_use():
            return {"num_replicas": self.world_size, "rank": self.global_rank}
        return {"num_replicas": self.plan.dp, "rank": self.dp_rank}

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica index under the plan (its placement: Plan.coordinates)."""
        return self.core.dp_rank

    def process_dataloader(self, dataloader: object) -> object:
        """Re-batch the training data into this rank's step batches of ``gas`` micro-batches of ``mbs`` (see data.py)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.plan is None or self.core.data is None or trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        return self.core.step_batches(first_step=lambda: trainer.global_step)

    # --- the step ------------------------------------------------------------------------------------

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the step's micro-batches: all but the last through the runtime here, the last through Lightning's loop.
        A collective in it that a hung or lost peer fails (ZeRO-3's gathers, the accumulated backwards' reductions, a
        pipeline's sends) ends this rank in one line (:func:`lightning_fleet.elastic.worker.collectives`), as in
        :meth:`backward` and :meth:`optimizer_step`."""
        with collectives(f"the training step ({self.backend.capabilities.label}'s forward and accumulated backward passes)", self._timeout):
            return self._training_step(*args, **kwargs)

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch, *rest = args
        if not isinstance(batch, MicroBatches):
            return super().training_step(*args, **kwargs)
        module = self.lightning_module
        self.core.rebalance(module.trainer.global_step, may=module.automatic_optimization and self._engine_in_use())
        if self._pipelined():
            return self._pipeline_step(batch)
        if not module.automatic_optimization:  # the plan has one micro-batch; the user steps
            return super().training_step(batch[0], *rest, **kwargs)
        self._zero_gradients()
        losses = []
        for micro in batch[:-1]:
            with self.backend.no_sync(self.engine):
                loss = _loss_of(super().training_step(micro, *rest, **kwargs))
                self.backend.accumulate(self.engine, self._weighted(loss), self._micro_backward)
            losses.append(loss.detach())
        output = super().training_step(batch[-1], *rest, **kwargs)
        last = _loss_of(output)
        mean = torch.stack([*losses, last.detach()]).mean()
        # the progress bar shows the step's mean loss; the gradient is still the last micro-batch's
        shown = last + (mean - last.detach())
        return {**output, "loss": shown} if isinstance(output, Mapping) else shown

    def _zero_gradients(self) -> None:
        """Before a step's first micro-batch, when the runtime does not zero gradients itself: the module's own
        ``optimizer_zero_grad`` for each optimizer (Lightning's call of it between micro-batches is replaced for the fit,
        Backend.module_patches)."""
        if self.backend.zeroes_gradients:
            return
        module = self.lightning_module
        trainer = module.trainer
        for optimizer in self.optimizers:
            type(module).optimizer_zero_grad(module, trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx, optimizer)

    def _micro_backward(self, loss: torch.Tensor) -> None:
        """Lightning's backward of a weighted micro-batch loss (the precision plugin and the module's backward hooks), for
        a runtime whose engine has no backward of its own."""
        optimizer = self.optimizers[0] if self.optimizers else None
        super().backward(loss, optimizer)

    def _pipeline_step(self, batch: MicroBatches) -> torch.Tensor:
        """One optimizer step through the pipeline schedule; Lightning's automatic loop only counts it, steps the
        schedulers and logs."""
        loss = self.backend.pipeline_step(self.engine, batch)
        self.lightning_module.log("train_loss", loss, prog_bar=True)
        return loss

    def _pipelined(self) -> bool:
        return self.core.pipelined(self.model)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Under a pipeline the engine ran backward inside its schedule already; otherwise the runtime's backward of the
        loss weighted by this replica's share (:meth:`_weighted`)."""
        if self._pipelined():
            return closure_loss
        with collectives(f"the backward pass (the loss check and {self.backend.capabilities.label}'s gradient reduction)", self._timeout):
            return super().backward(self._weighted(closure_loss), optimizer, *args, **kwargs)

    def _weighted(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times this replica's weight at the step being trained (:meth:`FitCore.loss_weight`) while the engine
        trains. The loss the user sees (progress bar, logs) stays unweighted."""
        if not self._engine_in_use():
            return loss
        weight = self.core.loss_weight(self.lightning_module.trainer.global_step)
        return loss if weight == 1.0 else loss * weight

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Under a pipeline the closure runs the step's schedule, which also stepped the engine. A collective that a hung
        or lost peer fails is one line (the closure's training step and backward name themselves)."""
        with collectives(f"the optimizer step ({self.backend.capabilities.label}'s gradient reduction and weight gather)", self._timeout):
            if self._pipelined():
                return closure()
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    def on_validation_start(self) -> None:
        """Under a pipeline each rank's engine trains only its stage: bring every stage's current weights into the module
        so that the user's own validation_step runs on the whole model."""
        if self._pipelined():
            self.backend.gather_stages(self.core.engine, self.lightning_module)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's validation_step; under a pipeline on the module itself (its stages synchronised at validation start)."""
        if not self._pipelined():
            return super().validation_step(*args, **kwargs)
        with self.precision_plugin.val_step_context():
            return self.lightning_module.validation_step(*args, **kwargs)

    # --- checkpoints ------------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        """The runtime's sharded checkpoint in ``filepath`` (every rank), and the layout file that lets
        :func:`lightning_fleet.export.export_state_dict` rebuild the full weights; whole on every rank on return."""
        if storage_options is not None:
            raise TypeError(f"Trainer.save_checkpoint(storage_options=...) is not supported by {type(self).__name__}: its checkpoints are directories")
        filepath = self.broadcast(filepath)  # every rank saves into rank 0's path
        self.core.save(self.engine, filepath, checkpoint)
        self.barrier("fleet-layout-written")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """fit: the core's load route (:meth:`FitCore.load`); validate/test/predict: any checkpoint of any plan as full
        weights, or a single file. Every file is read by the restricted unpickler."""
        path = Path(checkpoint_path)
        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            if path.is_dir():
                return lightning_checkpoint(path)
            return load_file(path, kind=KIND_LIGHTNING)  # our restricted unpickler, never torch's process-wide one
        return self.core.load(path, strict=self.lightning_module.strict_loading)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Evaluation loads the full weights into the module; a fit's engine loaded its state in load_checkpoint."""
        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``fleet`` (plan everything), ``fleet_zero3`` (ZeRO-3 only), ``fleet_offload`` (offload required)."""
        for name, (description, init_params) in PRESETS.items():
            strategy_registry.register(name, cls, description=description, override=True, **init_params)


class DeepSpeedFleetStrategy(FleetStrategy, DeepSpeedStrategy):
    """FleetStrategy's face for the DeepSpeed runtime: Lightning's DeepSpeedStrategy, whose precision plugin
    (DeepSpeedPrecision) runs backward and the optimizer step through the engine. Only what DeepSpeed's Lightning
    class needs lives here; everything else is FleetStrategy's."""

    def setup_environment(self) -> None:
        """DeepSpeedStrategy refuses non-CUDA accelerators; on CPU take the DDP path (gloo)."""
        if self.root_device.type == "cuda":
            DeepSpeedStrategy.setup_environment(self)
        else:
            DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        """DeepSpeed's device-index check rejects CPU devices (index None): FleetStrategy's path there."""
        if self.root_device.type == "cuda":
            return DeepSpeedStrategy.setup_distributed(self)  # calls _init_deepspeed_distributed
        return FleetStrategy.setup_distributed(self)

    def _init_deepspeed_distributed(self) -> None:
        """DeepSpeedStrategy's group set-up on CUDA: FleetStrategy's own (which lets DeepSpeed adopt it)."""
        self._open_process_group()

    def _adopt_process_group(self) -> None:
        """DeepSpeed adopts the open default group (``deepspeed.init_distributed``), its banner silenced."""
        with noise.without_banner():
            DeepSpeedStrategy._init_deepspeed_distributed(self)

    def _apply(self, trainer) -> None:  # type: ignore[no-untyped-def]
        """FleetStrategy's apply; DeepSpeedStrategy reads the runtime's configuration as ``self.config``."""
        super()._apply(trainer)
        self.config = self.core.runtime_config

    def _format_batch_size_and_grad_accum_config(self) -> None:
        """Micro-batch and accumulation come from the plan, not from the Trainer's flags."""
        assert isinstance(self.config, dict)
        if self.plan is None:  # Lightning may read the config before a fit planned it (e.g. tensor_init_context)
            self.config.setdefault("train_micro_batch_size_per_gpu", 1)
            self.config.setdefault("gradient_accumulation_steps", 1)

    def _init_optimizers(self) -> tuple[Any, Any]:
        """The runtime drives one optimizer (and one optional scheduler): refuse more before training, in one line."""
        from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

        optimizers, schedulers = _init_optimizers_and_lr_schedulers(self.lightning_module)
        if len(optimizers) != 1 or len(schedulers) > 1:
            raise FleetError(
                f"{type(self.lightning_module).__name__}.configure_optimizers() returns {len(optimizers)} optimizers and "
                f"{len(schedulers)} schedulers; strategy 'fleet' trains through DeepSpeed, which drives exactly one optimizer and "
                "at most one scheduler: combine the parameter groups into one optimizer (or use another strategy)"
            )
        return optimizers[0], schedulers[0] if schedulers else None

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):  # type: ignore[no-untyped-def]
        """DeepSpeedStrategy's engine seam: the runtime's engine (FleetStrategy._build_engine)."""
        return self._build_engine(model, optimizer, lr_scheduler)

    @property
    def deepspeed_engine(self) -> Any:
        """The engine of the last fit (it still saves checkpoints after the module was handed back for evaluation)."""
        return self.engine


class TorchFleetStrategy(FleetStrategy):
    """FleetStrategy's face for the torch runtime: Lightning's DDPStrategy (its precision plugins: autocast for
    "-mixed", the module cast for "-true"), whose ``configure_ddp`` builds the runtime's engine instead of a plain DDP
    wrapper. Only what DDPStrategy needs lives here; everything else is FleetStrategy's."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """A fit's checkpoint loads into the engine, which exists only after setup."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """The engine loads the optimizer's state with the weights (load_checkpoint), not Lightning."""
        return False

    def configure_ddp(self) -> None:
        """The runtime's engine over the module (DDPStrategy.setup calls this before it sets up the optimizers)."""
        self.model, _ = self._build_engine(self.model, None)

    def setup_optimizers(self, trainer) -> None:  # type: ignore[no-untyped-def]
        """Lightning's optimizers over the engine's parameters, then handed to the runtime (a shard level may wrap them)."""
        super().setup_optimizers(trainer)
        self.optimizers = [self.backend.optimizer(self.core.engine, optimizer, plan=self.plan) for optimizer in self.optimizers]

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """A fit's engine loaded the optimizer's state in load_checkpoint."""


# --- small helpers (module level: no strategy state) ------------------------------------------------


def _check_trainer_flags(trainer) -> None:  # type: ignore[no-untyped-def]
    """Trainer flags that the plan or the step order replace."""
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


def _autocast_precision(name: str, device_type: str) -> Any:
    """The precision plugin Lightning's accelerator connector builds for a DDP-class strategy and the Lightning
    ``precision`` ``name``: autocast for "-mixed", the module cast for "-true" half types, plain fp32 otherwise."""
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision
    from lightning.pytorch.plugins.precision import Precision as PlainPrecision

    if name.endswith("-mixed"):
        return MixedPrecision(name, device_type)  # type: ignore[arg-type]
    if name.startswith("64"):
        return DoublePrecision()
    if name.endswith("-true") and not name.startswith("32"):
        return HalfPrecision(name)  # type: ignore[arg-type]
    return PlainPrecision()


def _installed_runtime(name: str) -> Runtime:
    """The runtime called ``name`` when it can be imported here; FleetError (one line) otherwise."""
    runtime = runtime_named(name)
    if not runtime.installed():
        raise FleetError(
            f"FleetStrategy(runtime={name!r}): {runtime.requires} cannot be imported here; install it, or use runtime='auto' "
            f"(the installed ones: {', '.join(r.name for r in RUNTIMES if r.installed()) or 'none'})"
        )
    return runtime


def _runtime_of_class(cls: type) -> Runtime | None:
    """The runtime whose face ``cls`` is or derives from (None: FleetStrategy itself, or a user's subclass of it)."""
    names = {klass.__name__ for klass in cls.__mro__ if klass.__module__ == __name__}
    return next((r for r in RUNTIMES if r.face in names), None)


def _face_runtime(cls: type) -> Runtime:
    """The runtime whose face ``cls`` is."""
    runtime = _runtime_of_class(cls)
    assert runtime is not None, f"{cls.__name__} is no runtime's face"
    return runtime


_FACED: dict[tuple[type, str], type] = {}
"""(a user's FleetStrategy subclass, a runtime) -> that subclass on the runtime's face, made once."""


def _fixed_runtime(plan: Any) -> str:
    """The runtime a fixed plan names (``runtime=torch``), else "auto"; a plan that does not parse is left to setup's
    one-line refusal."""
    try:
        fixed = parse_partial_plan(plan).runtime if isinstance(plan, str) else getattr(plan, "runtime", None)
    except PlanError:
        return AUTO
    return fixed if fixed in RUNTIME_NAMES else AUTO


def _with_face(cls: type, runtime: Runtime) -> type:
    """``cls`` on ``runtime``'s face: the face itself for FleetStrategy or another face; for a user's subclass of
    FleetStrategy, a class deriving from both (its overrides first), named like it."""
    face = globals()[runtime.face]
    plain = next((klass for klass in cls.__mro__ if _runtime_of_class(klass) is None), FleetStrategy)
    if plain is FleetStrategy:
        return face
    key = (plain, runtime.name)
    if key not in _FACED:
        _FACED[key] = type(plain.__name__, (plain, face), {"__module__": plain.__module__, "__qualname__": plain.__qualname__})
    return _FACED[key]


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
