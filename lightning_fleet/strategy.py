"""FleetStrategy: the Lightning adapter. It decides once (:mod:`lightning_fleet.decide`: the plan and the runtime) and
applies the Decision through that runtime's backend (the runtime table, :data:`lightning_fleet.runtime.RUNTIMES`).

Three classes: :class:`FleetStrategy` (on Lightning's DDPStrategy) holds what every runtime shares -- the options a user
passes, the fit's setup order (read the data, measure the cluster, choose the checkpoint to continue, decide on rank 0
and broadcast once, apply), evaluation outside fit on whole-module replicas, the training step's micro-batches, their
loss weights, the load route and the hand-back -- and one thin face per runtime, on the Lightning class whose precision
plugin it needs: :class:`DeepSpeedFleetStrategy` (DeepSpeedStrategy, its CUDA-only seams lifted on CPU) and
:class:`TorchFleetStrategy` (DDPStrategy). ``FleetStrategy(...)`` becomes the face of the runtime asked for, and at
setup the face of the runtime the decision chose. The plan comes from the planning core, the runtime's calls from its
backend, the checkpoint layout from :mod:`lightning_fleet.elastic.layout`, the data order from
:mod:`lightning_fleet.data`. Imported by the package's ``__init__`` and the presets' registration; nothing below it
imports it (tests/test_layering.py).
"""

from __future__ import annotations

import dataclasses
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
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy  # noqa: E402
from lightning.pytorch.trainer.states import RunningStage, TrainerFn  # noqa: E402

from lightning_fleet.calibrate.measure import (  # noqa: E402
    WorldShape,
    across_ranks,
    cache_path,
    load_cached,
    device_memory_gib,
    measure,
    measure_ranks,
    save_cache,
    with_rank_devices,
)
from lightning_fleet.calibrate.measure import RANK_PROBE_S  # noqa: E402
from lightning_fleet.data import TrainingData, example_batch, inspect_training_loader, step_loader  # noqa: E402
from lightning_fleet.decide import (  # noqa: E402
    Decision,
    JobOptions,
    ModuleFacts,
    Resume,
    ResumeKind,
    decide,
    job_global_batch_size,
    resume_of,
    writer_of,
)
from lightning_fleet.elastic.callback import NON_FINITE_POLICIES, FleetCheckpoint, NonFiniteGuard  # noqa: E402
from lightning_fleet.elastic.checkpoint import VerifiedCheckpoint  # noqa: E402
from lightning_fleet.elastic.safe_load import load_file  # noqa: E402
from lightning_fleet.elastic.compatibility import RESUME_POLICIES, JobFacts, checkpoint_to_continue, job_facts  # noqa: E402
from lightning_fleet.elastic.layout import KIND_LIGHTNING, MANIFEST, rank_file, rank_file_name  # noqa: E402
from lightning_fleet.elastic.sampler import MicroBatches, ShareSchedule  # noqa: E402
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
from lightning_fleet.hooks import find_layers, module_hooks, tensor_parallel_hook  # noqa: E402
from lightning_fleet.planning import ClusterSpec, Estimate, FleetError, ModelSpec, Plan, PlanError, Precision, load_cluster  # noqa: E402
from lightning_fleet.planning.cluster import GIB  # noqa: E402
from lightning_fleet.planning.plan import parse_partial_plan, share_weight  # noqa: E402
from lightning_fleet.calibrate.ranks import rebalance_by  # noqa: E402
from lightning_fleet.profiling import Profile, profile  # noqa: E402
from lightning_fleet.progress import FleetProgress  # noqa: E402
from lightning_fleet.rng import RngState  # noqa: E402
from lightning_fleet.runtime import AUTO, RUNTIME_NAMES, RUNTIMES, Runtime, runtime_named  # noqa: E402
from lightning_fleet.runtime.base import ENGINE_CHECK  # noqa: E402
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
        for name, value in (("global_batch_size", global_batch_size), ("micro_batch_size", micro_batch_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise FleetError(f"FleetStrategy({name}={value!r}): must be a positive integer or None")
        every = rebalance_every_n_steps
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 0):
            raise FleetError(f"FleetStrategy(rebalance_every_n_steps={every!r}): must be a non-negative integer (0: never) or None")
        self.rebalance_every_n_steps = every
        if resume not in RESUME_POLICIES:
            raise FleetError(f"FleetStrategy(resume={resume!r}): must be one of {', '.join(map(repr, RESUME_POLICIES))}")
        self.options = JobOptions(
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
        """What the planner was asked (see :class:`lightning_fleet.decide.JobOptions`)."""
        self.cluster_source = cluster
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = (checkpoint_every_n_steps, checkpoint_every_n_seconds)
        self.resume, self.progress, self.hand_back = resume, progress, hand_back
        if non_finite not in NON_FINITE_POLICIES:
            choices = ", ".join(map(repr, NON_FINITE_POLICIES))
            raise FleetError(f"FleetStrategy(non_finite={non_finite!r}): must be one of {choices}")
        self.non_finite = non_finite
        self.runtime = runtime if runtime == AUTO else _installed_runtime(runtime).name
        """The runtime asked for: a name, or "auto" (the decision's ``runtime`` says which one trains)."""
        self.backend = _face_runtime(type(self)).load_backend()
        """The runtime that applies the decision (the face's; the chosen runtime's from setup on)."""
        self.decision: Decision | None = None
        """What this fit decided at setup (plan, estimate, cluster, resume); read-only afterwards."""
        self.profile: Profile | None = None
        """How the module was measured (method, fallbacks, what it means for the plan)."""
        self.startup_s: dict[str, float] = {}
        """Seconds spent at setup reading/measuring the cluster, choosing (verifying) the checkpoint to continue, profiling,
        and deciding (incl. broadcasts)."""
        self.resumed_from: Path | None = None
        """The checkpoint this fit resumed from (None for a fresh start)."""
        self._fit = _FitState()

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

    # --- what was decided ---------------------------------------------------------------------------

    @property
    def plan(self) -> Plan | None:
        """The plan being trained (set at setup)."""
        return self.decision.plan if self.decision is not None else None

    @property
    def rebalances(self) -> tuple[str, ...]:
        """What each rebalance of the last fit did (the lines rank 0 printed): the ranks' speeds, the step it was decided
        at, the new micro-batch sizes and the step they start at."""
        return tuple(self._fit.rebalanced)

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

    def checkpoint_facts(self) -> JobFacts:
        """What a checkpoint of this fit records so that only a compatible job resumes it (see elastic/compatibility.py)."""
        assert self._fit.facts is not None, "checkpoint_facts() is known from setup on"
        return self._fit.facts

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
                self._patch(distributed_c10d, name, self._timeout)
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        loop = trainer.fit_loop.epoch_loop if trainer is not None else None
        broadcast = strict_sigterm_broadcast(loop, self._timeout) if loop is not None else None
        if broadcast is not None:
            self._patch(loop, "_broadcast_sigterm_tensor", broadcast)
        die_with_agent()

    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")

    # --- setup: decide once, then apply ---------------------------------------------------------------

    def setup(self, trainer) -> None:  # type: ignore[no-untyped-def]
        """fit: decide (rank 0 decides, every rank reads the same Decision), apply it, let DeepSpeed set up;
        validate/test/predict: whole-module replicas."""
        if trainer.state.fn != TrainerFn.FITTING:
            self._setup_evaluation(trainer)
            return
        with deterministic_errors():  # every attempt of this job would raise them again: no restart loop
            _check_trainer_flags(trainer)
            fit = self._fit
            seed = self.broadcast(_sampler_seed())  # rank 0's: ranks seeded apart (seed + rank) still read one order
            fit.facts = job_facts(self.lightning_module, global_batch_size=self.options.global_batch_size, data_seed=seed)
            directory = self._attach_callbacks(trainer)
            fit.data = inspect_training_loader(_user_training_loader(trainer))
            self.decision = self._decide(trainer, directory)
            self._become(self.decision.runtime)
            self._apply(trainer)
            self._use_training_precision()
            super().setup(trainer)

    def _attach_callbacks(self, trainer) -> Path | None:  # type: ignore[no-untyped-def]
        """FleetProgress, NonFiniteGuard, and FleetCheckpoint for checkpoint_dir, which claims its directory (lock, probe)
        before anything reads it; the directory whose newest checkpoint a fit without ``ckpt_path`` continues (None: no
        FleetCheckpoint). Lightning's resume is pointed at the decided checkpoint."""
        if not any(isinstance(c, FleetProgress) for c in trainer.callbacks):
            trainer.callbacks.append(FleetProgress(lines=self.progress))
        if not any(isinstance(c, NonFiniteGuard) for c in trainer.callbacks):
            trainer.callbacks.insert(0, NonFiniteGuard(self.non_finite))  # a step's verdict before any callback saves it
        callbacks = [c for c in trainer.callbacks if isinstance(c, FleetCheckpoint)]
        if self.checkpoint_dir is not None and not callbacks:
            steps, seconds = self.checkpoint_every
            callbacks = [FleetCheckpoint(self.checkpoint_dir, every_n_steps=steps, every_n_seconds=seconds)]
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

    def _decide(self, trainer, directory: Path | None) -> Decision:  # type: ignore[no-untyped-def]
        """The fit's one Decision: rank 0 chooses the checkpoint to continue (verified once), every rank
        profiles the module at the resulting global batch, rank 0 decides; each step is broadcast once."""
        fit, started = self._fit, time.perf_counter()
        cluster = self._resolve_cluster()
        measured = time.perf_counter()
        requested = _requested_checkpoint(trainer)
        chosen = self._on_rank_zero(
            lambda: checkpoint_to_continue(Path(requested) if requested is not None else None, directory, fit.facts, self.resume)
        )
        path, manifest = (str(chosen.path), chosen.manifest) if chosen is not None else (None, None)
        assert fit.data is not None
        gbs = job_global_batch_size(self.options, loader_batch_size=fit.data.batch_size, world_size=self.world_size, manifest=manifest)
        chosen_at = time.perf_counter()
        facts = self._profile(trainer, fit.data, gbs)
        profiled = time.perf_counter()

        runtimes, runtime_notes = self._usable_runtimes(str(trainer.precision))

        def decide_here() -> Decision:
            resume = resume_of(path, manifest, self.world_size)
            decision = decide(facts, cluster, world_size=self.world_size, options=self.options,
                              runtimes=tuple(r.capabilities for r in runtimes), resume=resume,
                              cluster_notes=(fit.ranks_line,) if fit.ranks_line else (), runtime_notes=runtime_notes)
            print("\n".join(decision.report), flush=True)  # logged once, by the rank that decided
            return decision

        decision = self._on_rank_zero(decide_here)
        self.startup_s = {
            "cluster_s": measured - started,
            "checkpoint_s": chosen_at - measured,
            "profile_s": profiled - chosen_at,
            "plan_s": time.perf_counter() - profiled,
        }
        return decision

    def _usable_runtimes(self, precision: str) -> tuple[list[Runtime], tuple[str, ...]]:
        """The runtimes this fit may use (the one asked for, or under "auto" every installed one), those whose backend
        refuses the Lightning ``precision`` on this device left out, and a note for each left out."""
        asked = [runtime_named(self.runtime)] if self.runtime != AUTO else [r for r in RUNTIMES if r.installed()]
        usable, notes = [], []
        for runtime in asked:
            backend = self.backend if runtime.backend == _face_runtime(type(self)).backend else runtime.load_backend()
            refusal = backend.precision_refusal(precision, self.root_device.type)
            if refusal is None:
                usable.append(runtime)
            elif len(asked) == 1:
                raise FleetError(refusal)
            else:
                notes.append(f"not {runtime.name}: {refusal}")
        return usable, tuple(notes)

    def _become(self, name: str) -> None:
        """Turn into the face of the runtime the decision chose (the same object: the Trainer holds it): its class, its
        backend, and the precision plugin Lightning would have built for that class."""
        runtime = runtime_named(name)
        if _runtime_of_class(type(self)) is runtime:
            return
        self.__class__ = _with_face(type(self), runtime)
        self.backend = runtime.load_backend()
        self.precision_plugin = _autocast_precision(str(self.precision_plugin.precision), self.root_device.type)

    def _profile(self, trainer, data: TrainingData, global_batch_size: int) -> ModuleFacts:  # type: ignore[no-untyped-def]
        """Profile the module on the first samples of its training data (every rank; nothing of the module changes) and
        reduce the profile to what the decision needs."""
        module = self.lightning_module
        example = example_batch(data, data.batch_size)
        precision = Precision.from_lightning(str(trainer.precision))
        self.profile = profile(module, example, global_batch_size=global_batch_size, precision=precision, name=type(module).__name__)
        return ModuleFacts(
            spec=self.profile.spec,
            hooks=module_hooks(module, sparse_params=self.profile.sparse_params, pipeline_problem=self.profile.pipeline_problem),
            loader_batch_size=data.batch_size,
            batch_dependent=self.profile.batch_dependent,
            profile_lines=tuple(self.profile.report_lines()),
        )

    def _resolve_cluster(self) -> ClusterSpec:
        """The cluster to plan for: the one given (its size checked against the job), else this machine's measurement
        (rank 0's numbers, cached per host and world shape), its ranks probed at every start: a rank is described on
        its own only where this start's probe rounds all find it slower (the cache keeps no per-rank speed). Why the
        ranks were judged alike or different goes into the start-up report (``_fit.ranks_line``)."""
        shape = WorldShape(world_size=self.world_size, num_nodes=self.num_nodes, local_world_size=self.num_processes)
        if self.cluster_source is not None:
            cluster = self.cluster_source if isinstance(self.cluster_source, ClusterSpec) else load_cluster(self.cluster_source)
            if cluster.world_size != self.world_size:
                raise FleetError(
                    f"cluster {cluster.name!r} has {cluster.world_size} devices ({cluster.num_nodes} nodes x "
                    f"{cluster.devices_per_node}) but this job runs {self.world_size} processes ({self.num_nodes} nodes x "
                    f"{self.num_processes}): fix the cluster file or drop cluster= to measure this machine"
                )
            return cluster
        path = cache_path(self.root_device, shape)
        cached = self.broadcast(load_cached(path) if self.is_global_zero else None)
        if cached is not None:
            ranks = measure_ranks(self.root_device, device_memory_gib(self.root_device, self.num_processes))
            measured = with_rank_devices(cached, ranks)  # every rank gathered the same rounds: the same cluster
        else:
            measurement = measure(self.root_device, shape)
            ranks = measurement.ranks
            measured = self.broadcast(measurement.cluster)  # every rank plans with rank 0's numbers
            if self.is_global_zero:
                save_cache(measured, path)
        assert ranks is not None
        self._fit.ranks_line = ranks.judged().line()
        return measured

    def _apply(self, trainer) -> None:  # type: ignore[no-untyped-def]
        """Apply the decision: the runtime's config, a resharded checkpoint's conversion (rank 0, once), and the
        module changes the runtime needs for this fit (undone at teardown)."""
        decision = self.decision
        assert decision is not None
        resume = decision.resume
        if resume.kind is ResumeKind.RESHARD:
            assert resume.path is not None and resume.manifest is not None
            verified = VerifiedCheckpoint(Path(resume.path), resume.manifest)
            self._fit.universal = self._on_rank_zero(lambda: self._converted(verified))
        module = self.lightning_module
        tp = tensor_parallel_hook(module)
        self._fit.runtime_config = self.backend.config(
            decision.plan,
            gradient_clipping=float(trainer.gradient_clip_val or 0.0),
            device_type=self.root_device.type,
            tensor_parallel=tp[1] if tp else None,
            universal=resume.kind is ResumeKind.RESHARD,
        )
        for obj, name, value in self.backend.module_patches(module, decision.plan, find_layers(module), self.precision_plugin):
            self._patch(obj, name, value)

    def _converted(self, checkpoint: VerifiedCheckpoint) -> VerifiedCheckpoint:
        """Rank 0: the checkpoint to reshard in the form this fit's runtime loads: converted by that runtime when it wrote
        it; else its whole state exported by the runtime that did and imported by this one (each listed in the
        manifest once)."""
        writer = writer_of(checkpoint.manifest)
        if writer == self.backend.capabilities.name:
            return self.backend.reshard(checkpoint)
        exported = runtime_named(writer).load_backend().export_state(checkpoint)
        return self.backend.import_state(checkpoint, exported)

    def _build_engine(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
        """The runtime's engine over the module (recorded first: what the end of fit hands back)."""
        assert self.plan is not None
        self._fit.module_record = self.backend.record(model)  # before the runtime changes it
        for obj, name in self.backend.process_globals():
            self._patch(obj, name, getattr(obj, name))
        stack = find_layers(model)
        engine, optimizer = self.backend.build(
            model,
            optimizer,
            lr_scheduler,
            plan=self.plan,
            config=self._fit.runtime_config,
            device_rank=self.local_rank if self.root_device.index is None else self.root_device.index,
            layers=list(stack) if stack is not None else None,
        )
        self._fit.engine, self._fit.handed_back = engine, False
        return engine, optimizer

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

    # --- module changes for a fit, undone at teardown ----------------------------------------------

    def _patch(self, obj: Any, name: str, value: Any) -> None:
        """Set ``obj.name = value`` for this fit, remembering how to undo it."""
        had = name in vars(obj)
        self._fit.restorers.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, value)

    def _undo_module_patches(self) -> None:
        while self._fit.restorers:
            obj, name, had, old = self._fit.restorers.pop()
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)

    def teardown(self) -> None:
        """Undo what this strategy (and the runtime: ZeRO-3's process-wide ``F.linear``) changed for training: gradient
        zeroing, recomputation wrappers; the engine stays, for ``trainer.save_checkpoint`` after fit."""
        self._undo_module_patches()
        super().teardown()

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
        if self._fit.engine is not None and self._fit.module_record is not None:
            self.backend.hand_back(self, self._fit.module_record)  # a no-op when the end of training restored it already
        self.model = self.lightning_module
        self._undo_module_patches()

    @property
    def engine(self) -> Any:
        """The runtime's engine of the last fit (it still saves checkpoints after the module was handed back for
        evaluation)."""
        return self._fit.engine if self._fit.engine is not None else self.model

    @property
    def gradient_check(self) -> str:
        """How NonFiniteGuard checks a step's gradient while the engine trains (``Backend.gradient_check`` of the plan;
        under a pipeline, or outside fit, the engine's own way)."""
        plan = self.plan
        if not self._engine_in_use() or plan is None or plan.pp > 1:
            return ENGINE_CHECK
        return self.backend.gradient_check(plan)

    def _engine_in_use(self) -> bool:
        """Whether the runtime's engine trains or evaluates now (not after the module was handed back)."""
        return self._fit.engine is not None and self.model is self._fit.engine and not self._fit.handed_back

    def on_train_end(self) -> None:
        """Hand the user's module back, as a plain module in its original structure holding the trained weights on every
        rank (collective; runs after the callbacks' on_train_end, so after the final checkpoint, and only when training
        ended normally). The engine still saves checkpoints afterwards (runtime/deepspeed/weights.py). Skipped, with one
        line, when ``hand_back=False`` or when the whole model in fp32 on every local rank would not fit the host's memory."""
        record = self._fit.module_record
        if self._fit.engine is None or record is None or not self.hand_back:
            return
        needed = self.num_processes * self.backend.hand_back_bytes(record)
        available = across_ranks(float(psutil.virtual_memory().available), self.root_device)  # the least free
        if needed > 0.8 * available:
            if self.is_global_zero:
                print(
                    f"lightning_fleet: the module is left as {self.backend.capabilities.label} trained it: handing its {needed / self.num_processes / GIB:.1f} GiB "
                    f"of fp32 weights back to {self.num_processes} processes per node needs {needed / GIB:.1f} GiB of host memory, "
                    f"{available / GIB:.1f} GiB is free; export the weights instead (fleet export, README 'Getting the weights out')",
                    flush=True,
                )
            return
        self.backend.hand_back(self, record)
        self._fit.handed_back = True

    def _use_evaluation_precision(self) -> None:
        """Without an engine, mixed precision is autocast (DeepSpeed casts the module itself during fit)."""
        if self._fit.training_precision is None:
            self._fit.training_precision = self.precision_plugin
        self.precision_plugin = _autocast_precision(str(self._fit.training_precision.precision), self.root_device.type)

    def _use_training_precision(self) -> None:
        if self._fit.training_precision is not None:
            self.precision_plugin = self._fit.training_precision
            self._fit.training_precision = None

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
        assert self.plan is not None
        return self.plan.coordinates(self.global_rank).dp

    def process_dataloader(self, dataloader: object) -> object:
        """Re-batch the training data into this rank's step batches of ``gas`` micro-batches of ``mbs`` (see data.py)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        data = self._fit.data
        if self.plan is None or data is None or trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        plan = self.plan
        self._fit.shares = ShareSchedule(plan.uneven_shares())
        workers = data.options.num_workers
        self._fit.prefetched_steps = 2 + (data.options.prefetch_factor or 2) * workers if workers else 2
        with deterministic_errors():  # e.g. fewer samples than one global batch: every attempt would say so again
            return step_loader(
                data,
                global_batch_size=plan.global_batch_size,
                dp_size=plan.dp,
                dp_rank=self.dp_rank,
                gas=plan.gas,
                shares=self._fit.shares,
                seed=self.checkpoint_facts().data_seed,  # the seed the checkpoints record
                first_step=lambda: trainer.global_step,
            )

    # --- the step ------------------------------------------------------------------------------------

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the step's micro-batches: all but the last through the runtime here, the last through Lightning's loop.
        A collective in it that a hung or lost peer fails (ZeRO-3's gathers, the accumulated backwards' reductions, a
        pipeline's sends) ends this rank in one line (:func:`lightning_fleet.elastic.worker.collectives`), as in
        :meth:`backward` and :meth:`optimizer_step`."""
        with collectives("the training step (DeepSpeed's forward and accumulated backward passes)", self._timeout):
            return self._training_step(*args, **kwargs)

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch, *rest = args
        if not isinstance(batch, MicroBatches):
            return super().training_step(*args, **kwargs)
        self._rebalance()
        if self._pipelined():
            return self._pipeline_step(batch)
        if not self.lightning_module.automatic_optimization:  # the plan has one micro-batch; the user steps
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
        return self._engine_in_use() and self.plan is not None and self.plan.pp > 1

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Under a pipeline the engine ran backward inside its schedule already; otherwise the runtime's backward of the
        loss weighted by this replica's share (:meth:`_weighted`)."""
        if self._pipelined():
            return closure_loss
        with collectives("the backward pass (the loss check and DeepSpeed's gradient reduction)", self._timeout):
            return super().backward(self._weighted(closure_loss), optimizer, *args, **kwargs)

    def _weighted(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times this replica's share of the step being trained over an equal share, when the replicas' shares
        differ (``dp_mbs``, :class:`ShareSchedule`): the runtime averages the replicas' gradients, which is then the
        mean over the global batch; and over the step's micro-batches where the runtime sums their gradients
        (``Backend.averages_micro_batches`` False). The loss the user sees (progress bar, logs) stays unweighted."""
        if not self._engine_in_use():
            return loss
        schedule = self._fit.shares
        shares = schedule.at(self.lightning_module.trainer.global_step) if schedule is not None else None
        weight = share_weight(shares, self.dp_rank) if shares is not None else 1.0
        if not self.backend.averages_micro_batches and self.plan is not None and self.plan.gas > 1:
            weight /= self.plan.gas
        return loss if weight == 1.0 else loss * weight

    def _rebalance(self) -> None:
        """Every ``rebalance_every_n_steps`` steps (collective: every rank trains the same step): probe each rank's
        sustained speed; when the planner finds a split of each micro-step's samples by them predicted REBALANCE_GAIN
        faster than the one in use (:func:`planning.search.rebalance`), use it from the first step the data pipeline has
        not cut yet (the sampler and the loss weights read the
        same :class:`ShareSchedule`); the plan and its estimate follow from that step on."""
        trainer, decision, fit = self.lightning_module.trainer, self.decision, self._fit
        step = trainer.global_step
        every = REBALANCE_EVERY_N_STEPS if self.rebalance_every_n_steps is None else self.rebalance_every_n_steps
        if decision is None or fit.shares is None:
            return
        pending = fit.pending
        if pending is not None and step >= pending[0]:
            self.decision, fit.pending = dataclasses.replace(decision, plan=pending[1].plan, estimate=pending[1]), None
            return
        if not every or step == 0 or step % every or not self._may_rebalance() or pending is not None:
            return
        if self.rebalance_every_n_steps is None:  # automatic: keep the probes' share of the time trained small
            since = across_ranks(time.perf_counter() - fit.last_probe, self.root_device)  # the same answer on every rank
            if since * REBALANCE_OVERHEAD < RANK_PROBE_S:
                return
        fit.last_probe = time.perf_counter()
        ranks = measure_ranks(self.root_device, device_memory_gib(self.root_device, self.num_processes))
        start = step + fit.prefetched_steps
        change = rebalance_by(ranks, decision.estimate.model, decision.cluster, decision.estimate.plan,
                              overlaps=self.backend.capabilities.overlaps, step=step, start=start)
        if change is None:
            return
        new, line = change
        fit.shares.set_from(start, new.plan.uneven_shares())
        fit.pending = (start, new)
        fit.rebalanced.append(line)
        if self.global_rank == 0:
            print(line, flush=True)

    def _may_rebalance(self) -> bool:
        """Rebalancing keeps the optimisation only for a data-parallel plan of a loss known to be a per-sample mean,
        stepped by the engine, on a runtime that weights replicas."""
        plan, module = self.plan, self.lightning_module
        return (plan is not None and plan.dp > 1 and plan.pp == 1 and self.backend.capabilities.uneven_dp
                and self.profile is not None and self.profile.batch_dependent is False
                and getattr(module, "automatic_optimization", True) and self._engine_in_use())

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Under a pipeline the closure runs the step's schedule, which also stepped the engine. A collective that a hung
        or lost peer fails is one line (the closure's training step and backward name themselves)."""
        with collectives("the optimizer step (DeepSpeed's gradient reduction and weight gather)", self._timeout):
            if self._pipelined():
                return closure()
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    def on_validation_start(self) -> None:
        """Under a pipeline each rank's engine trains only its stage: bring every stage's current weights into the module
        so that the user's own validation_step runs on the whole model."""
        if self._pipelined():
            self.backend.gather_stages(self._fit.engine, self.lightning_module)

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
        self.backend.save(self.engine, filepath, checkpoint)
        self.backend.write_layout(self, filepath, self._fit.module_record)  # every rank (collective for ZeRO-0 fp16/bf16 masters); rank 0 writes
        self.barrier("fleet-layout-written")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """fit: the decided FleetCheckpoint step (verified once at setup, each file checked again as it is read; resharded
        or as written, with each rank's RNG), or a ``trainer.save_checkpoint`` dir; validate/test/predict: any checkpoint
        of any plan as full weights, or a single file. Every file is read by the restricted unpickler."""
        path = Path(checkpoint_path)
        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            if path.is_dir():
                return lightning_checkpoint(path)
            return load_file(path, kind=KIND_LIGHTNING)  # our restricted unpickler, never torch's process-wide one
        resume = self.decision.resume if self.decision is not None else None
        if resume is None or resume.path is None or Path(resume.path) != path:
            return self._load_plain(path)
        return self._load_decided(path, resume)

    def _load_plain(self, path: Path) -> dict[str, Any]:
        """A ``trainer.save_checkpoint`` dir given as ``ckpt_path`` (no manifest): loaded by the restricted unpickler."""
        if (path / MANIFEST).is_file():  # only the step decided at setup is continued
            raise FleetError(f"checkpoint {path} was not the one this fit decided to continue at setup; pass it as ckpt_path")
        _check_is_directory(path)
        strict = self.lightning_module.strict_loading
        return self.backend.load(self.engine, path, optimizer_states=True, strict=strict, checkpoint=None)

    def _load_decided(self, path: Path, resume: Resume) -> dict[str, Any]:
        """The FleetCheckpoint step the decision continues: its universal form when resharded, else its shards and this
        rank's RNG state."""
        manifest, strict = resume.manifest, self.lightning_module.strict_loading
        assert manifest is not None
        engine = self.engine
        if resume.kind is ResumeKind.RESHARD:
            assert self._fit.universal is not None
            state = self.backend.load(engine, self.backend.derived_of(self._fit.universal), optimizer_states=True, strict=strict,
                                      checkpoint=self._fit.universal)
            how = f"resharded from {manifest.world_size} to {self.world_size} processes, {manifest.plan} -> {self.plan}"
        else:
            checkpoint = VerifiedCheckpoint(path, manifest)
            state = self.backend.load(engine, self.backend.state_of(path), optimizer_states=True, strict=strict, checkpoint=checkpoint)
            name = rank_file_name(self.global_rank)
            rng = manifest.files.get(name)
            if rng is not None:
                RngState.from_checkpoint(load_file(rank_file(path, self.global_rank), rng, kind=manifest.kinds[name])).install()
            how = "same plan and world"
        self.resumed_from = path
        if self.is_global_zero:
            print(f"lightning_fleet: resumed from {path} (step {manifest.step}; {how})", flush=True)
        return state

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
        self.config = self._fit.runtime_config

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
        self.optimizers = [self.backend.optimizer(self._fit.engine, optimizer, plan=self.plan) for optimizer in self.optimizers]

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """A fit's engine loaded the optimizer's state in load_checkpoint."""


class _FitState:
    """What one fit's setup hands to the later hooks besides the Decision (mutable, per fit)."""

    def __init__(self) -> None:
        self.facts: JobFacts | None = None  # what a checkpoint of this job records (elastic/compatibility.py)
        self.data: TrainingData | None = None  # the user's training data, as the strategy re-batches it
        self.universal: VerifiedCheckpoint | None = None  # the decided checkpoint listing its resharded form (rank 0 converted it)
        self.engine: Any = None  # the runtime's engine of the last fit (kept for saving after evaluation)
        self.handed_back = False  # the end of that fit handed the user's module back (the engine no longer runs it)
        self.module_record: Any = None  # what the backend's hand_back restores at the end of fit
        self.runtime_config: Any = None  # the runtime's configuration of the decided plan (Backend.config)
        self.restorers: list[Any] = []  # how to undo this fit's module patches
        self.training_precision: Any = None  # DeepSpeed's precision plugin while an evaluation uses a plain one
        self.shares: ShareSchedule | None = None  # the replicas' shares by step (the sampler cuts by it, losses are weighted by it)
        self.prefetched_steps = 2  # steps the data pipeline may have cut ahead of the one training (a share change starts later)
        self.rebalanced: list[str] = []  # what each rebalance did, as reported
        self.pending: tuple[int, Estimate] | None = None  # a share change decided, and the step it starts at
        self.last_probe = time.perf_counter()  # when the ranks last probed their speed (the fit's start before that)
        self.ranks_line: str | None = None  # why the measured ranks were judged alike or different (start-up report)


# --- small helpers (module level: no strategy state) ------------------------------------------------


REBALANCE_EVERY_N_STEPS = 100
"""How often (in optimizer steps) the ranks probe their speed when ``rebalance_every_n_steps`` is left at None."""
REBALANCE_OVERHEAD = 0.01
"""The most of the time trained that automatic rebalancing's probes may take (each takes RANK_PROBE_S)."""
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


def _check_is_directory(path: Path) -> None:
    if not path.is_dir():
        raise FleetError(f"checkpoint {path} is not a directory: strategy 'fleet' resumes a fit from a FleetCheckpoint step or a trainer.save_checkpoint dir")


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
