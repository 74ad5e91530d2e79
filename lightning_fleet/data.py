"""The user's training data, read the way a plan needs it: one global sample order, each rank's share per step.

The strategy keeps what it needs of the user's training DataLoader (:func:`inspect_training_loader`),
profiles with :func:`example_batch` and trains from :func:`step_loader`, which yields this
data-parallel rank's :class:`~lightning_fleet.elastic.sampler.MicroBatches` per optimizer step.
Step ``s`` is global samples ``s*G .. (s+1)*G - 1`` of the epoch; rank ``r`` keeps the contiguous
``G/dp`` share ``r`` of them, so the ranks' shares together are the global batch of a single process
whatever dp, mbs and gas are.

Map-style data has one global order per epoch: identity (``SequentialSampler``), the seeded
permutation of :class:`~lightning_fleet.elastic.sampler.GlobalBatchSampler` (``shuffle=True``, also a
user ``DistributedSampler``'s shuffle flag), or the indices the user's own sampler yields
(``SubsetRandomSampler``, ``WeightedRandomSampler``, any ``Sampler``; see :class:`SamplerOrder`). An
epoch has ``len(order) // G`` steps (the incomplete tail is dropped); step ``g`` of the job is step
``g % S`` of epoch ``g // S``.

A stream (``IterableDataset``) is read by every rank in full, one sample at a time, through a
DataLoader with the user's worker options; each rank keeps its share of each consecutive group of
``G`` samples, so the stream must yield the same sequence on every rank (see :class:`StreamSteps`).

Imports torch, the sampler and the RNG helpers; imported by the strategy (and tests).
"""

from __future__ import annotations

import copy
import hashlib
import random
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import islice
from typing import Any, Callable, Iterator

import numpy
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler

from lightning_fleet import rng
from lightning_fleet.elastic.sampler import (
    GlobalBatchSampler,
    MicroBatchCollate,
    MicroBatches,
    ShareSchedule,
    check_shares,
    rank_share,
)
from lightning_fleet.planning import FleetError
from lightning_fleet.rng import RngState


class DataKind(StrEnum):
    """How the training dataset is read."""

    MAP = "map-style"
    """Indexed (``dataset[key]``) by the keys of a global order."""
    STREAM = "stream"
    """An ``IterableDataset``, read from its start; one pass is one epoch."""


class OrderSource(StrEnum):
    """Where an epoch's global sample order comes from."""

    SEQUENTIAL = "sequential"
    """Dataset order (``SequentialSampler``, or a ``DistributedSampler`` without shuffle)."""
    SHUFFLED = "shuffled"
    """The seeded permutation of :class:`GlobalBatchSampler` (``shuffle=True`` or a shuffling ``DistributedSampler``)."""
    SAMPLER = "sampler"
    """The indices the user's own sampler yields (:class:`SamplerOrder`)."""
    STREAM = "stream"
    """The order in which the stream yields its samples."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoaderOptions:
    """The user's DataLoader settings that the strategy's loaders keep (not its generator: the order is seeded)."""

    num_workers: int = 0
    """Worker processes that load samples."""
    pin_memory: bool = False
    """Copy batches into page-locked memory."""
    worker_init_fn: Callable[[int], None] | None = None
    """Called in each worker with its id."""
    persistent_workers: bool = False
    """Keep the workers between epochs (map-style data; a stream restarts its workers every pass)."""
    multiprocessing_context: Any = None
    """The workers' start method or context."""
    prefetch_factor: int | None = None
    """Samples or batches loaded ahead per worker."""
    timeout: float = 0.0
    """Seconds to wait for a worker's batch (0: forever)."""

    @classmethod
    def of(cls, loader: DataLoader) -> LoaderOptions:
        """The options of ``loader``."""
        return cls(
            num_workers=loader.num_workers,
            pin_memory=loader.pin_memory,
            worker_init_fn=loader.worker_init_fn,
            persistent_workers=loader.persistent_workers,
            multiprocessing_context=loader.multiprocessing_context,
            prefetch_factor=loader.prefetch_factor,
            timeout=loader.timeout,
        )

    def kwargs(self) -> dict[str, Any]:
        """DataLoader keyword arguments; those DataLoader allows only with workers are left out without them."""
        args: dict[str, Any] = {
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "worker_init_fn": self.worker_init_fn,
            "timeout": self.timeout,
        }
        if self.num_workers > 0:
            args |= {
                "persistent_workers": self.persistent_workers,
                "multiprocessing_context": self.multiprocessing_context,
                "prefetch_factor": self.prefetch_factor,
            }
        return args


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingData:
    """What the strategy keeps of the user's training DataLoader (see :func:`inspect_training_loader`)."""

    dataset: Dataset
    """The user's dataset, read by the strategy's loaders."""
    kind: DataKind
    """Map-style or stream."""
    batch_size: int
    """The per-process batch size (the default global batch is this times the world size)."""
    collate_fn: Callable[[list[Any]], Any]
    """Collates one micro-batch's samples."""
    order: OrderSource
    """Where an epoch's global order comes from."""
    sampler: Sampler | None = None
    """The user's sampler where ``order`` is ``SAMPLER`` (never iterated itself: see :class:`SamplerOrder`)."""
    options: LoaderOptions = field(default_factory=LoaderOptions)
    """The loader options to carry over."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise FleetError(f"TrainingData(batch_size={self.batch_size}): must be a positive integer")
        if (self.kind is DataKind.STREAM) != (self.order is OrderSource.STREAM):
            raise FleetError(f"TrainingData(kind={self.kind}, order={self.order}): a stream has its own order and only a stream")
        if (self.order is OrderSource.SAMPLER) != (self.sampler is not None):
            raise FleetError(f"TrainingData(order={self.order}): a sampler is given exactly when the order comes from it")

    @property
    def shuffled(self) -> bool:
        """Whether the order is the strategy's seeded permutation."""
        return self.order is OrderSource.SHUFFLED


def inspect_training_loader(loader: object) -> TrainingData:
    """What the strategy needs of the user's training DataLoader; one FleetError line for what it cannot honour.

    Give it the loader the user returned (``trainer.fit_loop._data_source.dataloader()``). Lightning's
    re-instantiated one also works (its ``DistributedSamplerWrapper`` is unwrapped to the user's sampler),
    but Lightning replaces a ``RandomSampler`` with replacement or ``num_samples`` by a plain shuffling
    ``DistributedSampler`` there, so the user's loader is the exact source.
    """
    if not isinstance(loader, DataLoader):
        raise FleetError(
            f"strategy 'fleet' trains from one torch DataLoader, but the training data is a {type(loader).__name__}: "
            "return a single DataLoader from train_dataloader()"
        )
    stream = isinstance(loader.dataset, IterableDataset)
    if loader.batch_size is None:
        raise FleetError(_unbatched(loader, stream))
    order, sampler = (OrderSource.STREAM, None) if stream else _order_of(loader)
    return TrainingData(
        dataset=loader.dataset,
        kind=DataKind.STREAM if stream else DataKind.MAP,
        batch_size=int(loader.batch_size),
        collate_fn=loader.collate_fn,
        order=order,
        sampler=sampler,
        options=LoaderOptions.of(loader),
    )


def _unbatched(loader: DataLoader, stream: bool) -> str:
    """Why a loader without ``batch_size`` cannot be re-batched, and what to do."""
    if loader.batch_sampler is not None:
        return (
            f"the training DataLoader has a custom batch_sampler ({type(loader.batch_sampler).__name__}), but under strategy "
            "'fleet' the plan forms the batches: pass the order as sampler= and the per-process batch_size= instead"
        )
    if stream:
        return (
            "the training DataLoader over an IterableDataset has batch_size=None, but under strategy 'fleet' the strategy "
            "batches the stream: let the dataset yield single samples and set batch_size= to the per-process batch"
        )
    return (
        "the training DataLoader has batch_size=None, but under strategy 'fleet' the plan forms the batches from single "
        "samples: set batch_size= to the per-process batch"
    )


def _order_of(loader: DataLoader) -> tuple[OrderSource, Sampler | None]:
    """The order source of a map-style loader, and the user's sampler where the order comes from it."""
    sampler, dataset = _unwrapped(loader.sampler), loader.dataset
    kind = type(sampler)
    if kind is SequentialSampler and sampler.data_source is dataset:
        return OrderSource.SEQUENTIAL, None
    if kind is RandomSampler and sampler.data_source is dataset and not sampler.replacement:
        if sampler.num_samples == len(dataset):  # DataLoader(shuffle=True): every sample once per epoch
            return OrderSource.SHUFFLED, None
    if kind is DistributedSampler:  # the strategy splits the order across ranks itself
        return (OrderSource.SHUFFLED if sampler.shuffle else OrderSource.SEQUENTIAL), None
    if isinstance(sampler, DistributedSampler):
        raise FleetError(
            f"the training sampler {kind.__name__} is a DistributedSampler subclass that keeps one rank's share, but under "
            "strategy 'fleet' the strategy splits one global order across ranks: pass a sampler over the whole dataset"
        )
    return OrderSource.SAMPLER, sampler


def _unwrapped(sampler: Sampler) -> Sampler:
    """The user's sampler inside Lightning's ``DistributedSamplerWrapper``, else ``sampler`` (Lightning stays unimported)."""
    for name in ("lightning.fabric.utilities.distributed", "lightning_fabric.utilities.distributed"):
        module = sys.modules.get(name)
        if module is not None and isinstance(sampler, module.DistributedSamplerWrapper):
            return sampler.dataset._sampler  # type: ignore[attr-defined]
    return sampler


def example_batch(data: TrainingData, samples: int) -> Any:
    """The first ``samples`` samples of the training data, collated: a batch to profile with.

    The user's loader is not iterated and no RNG stream of the process is consumed (the reading and
    the collate function run under isolated RNGs). Map-style data reads the first keys of the order
    (a user sampler's as :class:`SamplerOrder` iterates it, seeded by 0), a stream the start of a
    fresh iterator of its dataset in this process.
    """
    with rng.seeded(None):
        first = _first_samples(data, samples)
        if not first:
            raise FleetError("the training data yielded no sample: give the training DataLoader a non-empty dataset")
        return data.collate_fn(first)


def _first_samples(data: TrainingData, samples: int) -> list[Any]:
    if data.kind is DataKind.STREAM:
        return list(islice(iter(data.dataset), samples))  # type: ignore[call-overload]
    if data.order is OrderSource.SAMPLER:
        assert data.sampler is not None
        keys: Any = list(islice(iter(_sampler_view(data.sampler, 0, 0)), samples))
    else:
        keys = range(min(samples, _map_len(data.dataset)))
    return [data.dataset[key] for key in keys]


def step_loader(
    data: TrainingData,
    *,
    global_batch_size: int,
    dp_size: int,
    dp_rank: int,
    gas: int,
    seed: int,
    first_step: Callable[[], int],
    shares: tuple[int, ...] | ShareSchedule | None = None,
) -> DataLoader:
    """A DataLoader that yields this data-parallel rank's :class:`MicroBatches` (``gas`` of them) per optimizer step.
    ``shares`` (samples per replica and step, :meth:`Plan.replica_samples`, or a :class:`ShareSchedule` of them by step)
    gives the replicas unequal contiguous shares; without it each takes ``global_batch_size / dp_size``.

    ``first_step()`` is read when an iteration starts (Lightning: ``trainer.global_step``): the position
    is keyed by the global optimizer step, so a resumed or resized job continues exactly. ``seed`` is
    the data-order seed, identical on every rank.
    """
    _check_split(global_batch_size, dp_size, dp_rank, gas, shares)
    collate = MicroBatchCollate(data.collate_fn, gas)
    if data.kind is DataKind.STREAM:
        split = {"global_batch_size": global_batch_size, "dp_size": dp_size, "dp_rank": dp_rank, "shares": shares}
        steps = StreamSteps(data, **split, collate=collate, seed=seed, first_step=first_step)
        # num_workers=0: steps are grouped here, the user's workers load the samples (StreamSteps); own generator: no RNG draw
        pin = data.options.pin_memory
        return DataLoader(steps, batch_size=None, collate_fn=_as_is, pin_memory=pin, generator=torch.Generator())
    sampler = _global_batch_sampler(data, global_batch_size, dp_size, dp_rank, seed, first_step, shares)
    return _StepLoader(data.dataset, batch_sampler=sampler, collate_fn=collate, seed=seed, **data.options.kwargs())


class _StepLoader(DataLoader):
    """The step DataLoader of map-style data. Each iteration draws its workers' base seed from a generator of its own,
    seeded by (seed, epoch), not from the global torch RNG: an iterator created mid-epoch by a resumed job would
    otherwise draw once more than the job that never stopped, and its dropout would continue another random stream;
    and an epoch's workers get the same seeds whether or not the job was resumed."""

    def __init__(self, *args: Any, seed: int, **kwargs: Any) -> None:
        super().__init__(*args, generator=torch.Generator(), **kwargs)
        self.seed = seed

    def __iter__(self) -> Any:
        sampler = self.batch_sampler
        assert isinstance(sampler, GlobalBatchSampler)
        self.generator.manual_seed(_mix(self.seed, "workers", sampler.first_step() // sampler.steps_per_epoch))
        return super().__iter__()


def _check_split(
    global_batch_size: int, dp_size: int, dp_rank: int, gas: int, schedule: tuple[int, ...] | ShareSchedule | None
) -> None:
    if min(global_batch_size, dp_size, gas) < 1 or not 0 <= dp_rank < dp_size:
        raise FleetError(
            f"step_loader(global_batch_size={global_batch_size}, dp_size={dp_size}, dp_rank={dp_rank}, gas={gas}): out of range"
        )
    shares = ShareSchedule.of(schedule).at(0)
    if shares is not None:
        try:
            check_shares(shares, global_batch_size=global_batch_size, dp_size=dp_size, gas=gas)
        except ValueError as err:
            raise FleetError(f"step_loader: {err}") from None
    elif global_batch_size % (dp_size * gas):
        raise FleetError(
            f"global batch {global_batch_size} does not split into dp {dp_size} x gas {gas} equal micro-batches: "
            f"use a global batch divisible by {dp_size * gas}"
        )


def _global_batch_sampler(
    data: TrainingData, global_batch_size: int, dp_size: int, dp_rank: int, seed: int, first_step: Callable[[], int],
    shares: tuple[int, ...] | ShareSchedule | None,
) -> GlobalBatchSampler:
    order = SamplerOrder(data.sampler, seed) if data.sampler is not None else None
    num_samples = len(order) if order is not None else _map_len(data.dataset)
    if num_samples < global_batch_size:
        raise FleetError(
            f"the training data has {num_samples} samples per epoch, fewer than one global batch of {global_batch_size}: "
            "lower the global batch size or add data"
        )
    return GlobalBatchSampler(
        num_samples,
        global_batch_size=global_batch_size,
        dp_size=dp_size,
        dp_rank=dp_rank,
        shuffle=data.shuffled,
        seed=seed,
        first_step=first_step,
        epoch_order=order,
        shares=shares,
    )


def _map_len(dataset: Dataset) -> int:
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError as err:
        raise FleetError(
            f"the map-style training dataset {type(dataset).__name__} has no len(): "
            "give it __len__, or a sampler= that yields its keys"
        ) from err


def _as_is(sample: Any) -> Any:
    """The collate function for single samples and finished step batches: keep them exactly as they are."""
    return sample


# --- a user sampler's order -----------------------------------------------------------------------


class SamplerOrder:
    """Epoch ``e``'s global order: the keys the user's sampler yields, reproducible and identical on every rank.

    The sampler is iterated as a shallow copy on which every RNG attribute (a torch ``Generator``,
    ``random.Random``, a NumPy ``Generator``/``RandomState``, e.g. ``generator``) is replaced by a fresh
    one seeded by ``(seed, e)`` and ``set_epoch(e)`` is called where it exists, under torch's,
    Python's and NumPy's global RNGs seeded the same way and restored afterwards. The user's
    sampler, its generator and the process's RNG streams are left as they were. The sampler must be
    finite and yield the same number of keys every epoch (its ``len()`` where it has one).
    """

    def __init__(self, sampler: Sampler, seed: int) -> None:
        self.sampler, self.seed = sampler, seed
        self._declared = _declared_len(sampler)
        self._last: tuple[int, list[Any]] | None = None
        self._length = self._declared
        if self._length is None:
            self._length = len(self(0))

    def __len__(self) -> int:
        """Keys per epoch."""
        assert self._length is not None
        return self._length

    def __call__(self, epoch: int) -> list[Any]:
        """The keys of ``epoch``, in order."""
        if self._last is not None and self._last[0] == epoch:
            return self._last[1]
        seed = _mix(self.seed, "sampler", epoch)
        with rng.seeded(seed):
            keys = iter(_sampler_view(self.sampler, seed, epoch))
            order = list(keys if self._declared is None else islice(keys, self._declared + 1))
        expected = self._length if self._length is not None else len(order)
        if len(order) != expected:
            raise FleetError(
                f"the training sampler {type(self.sampler).__name__} yielded {len(order)} keys in epoch {epoch}, expected "
                f"{expected} (its len() or epoch 0): a sampler must yield the same number of keys every epoch"
            )
        self._last = (epoch, order)
        return order


def _declared_len(sampler: Sampler) -> int | None:
    try:
        return len(sampler)  # type: ignore[arg-type]
    except TypeError:
        return None


def _sampler_view(sampler: Sampler, seed: int, epoch: int) -> Sampler:
    """A shallow copy of ``sampler`` with fresh RNGs seeded by ``seed``, at ``epoch``."""
    try:
        view = copy.copy(sampler)
    except Exception as err:  # noqa: BLE001 - any failure of a user object's copy protocol
        raise FleetError(
            f"the training sampler {type(sampler).__name__} cannot be copied ({err}); strategy 'fleet' iterates a copy to "
            "leave yours untouched: make it copyable with copy.copy"
        ) from err
    for name, value in getattr(sampler, "__dict__", {}).items():
        fresh = _fresh_rng_like(value, seed)
        if fresh is not None:
            setattr(view, name, fresh)
    set_epoch = getattr(view, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
    return view


def _fresh_rng_like(value: Any, seed: int) -> Any:
    """A new RNG of ``value``'s kind seeded by ``seed``, or None where ``value`` is no RNG."""
    if isinstance(value, torch.Generator):
        return torch.Generator(device=value.device).manual_seed(seed)
    if isinstance(value, random.Random):
        return random.Random(seed)
    if isinstance(value, numpy.random.Generator):
        return numpy.random.default_rng(seed)
    if isinstance(value, numpy.random.RandomState):
        return numpy.random.RandomState(seed % 2**32)
    return None


# --- RNG isolation ----------------------------------------------------------------------------------


def _mix(seed: int, purpose: str, index: int) -> int:
    """A 63-bit seed for (``seed``, ``purpose``, ``index``), the same on every machine and Python."""
    digest = hashlib.blake2b(f"{seed}/{purpose}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _PrivateRngs:
    """A reader's own global-RNG states, swapped in only while it reads."""

    def __init__(self, seed: int) -> None:
        self.state = RngState.seeded(seed)

    @contextmanager
    def active(self) -> Iterator[None]:
        with rng.kept(cuda=False):
            self.state.install()
            try:
                yield
            finally:
                self.state = RngState.capture(cuda=False)


# --- streams ------------------------------------------------------------------------------------------


class StreamSteps(IterableDataset):
    """This rank's step batches from a stream, keyed by the global step.

    Every rank reads the whole stream and keeps its share of each consecutive group of ``G``
    samples, so the stream must yield the same sequence on every rank (do not shard it by rank
    yourself; shard by DataLoader worker with ``get_worker_info()`` if you like). Pass ``p`` of the
    stream (``set_epoch(p)`` first where the dataset has it) is read through a DataLoader with the
    user's worker options, ``batch_size=None``, workers seeded by ``(seed, p)`` and started afresh
    every pass; in this process the dataset runs under its own RNG states seeded by ``(seed, p)``, so
    it may shuffle with the global RNGs and the training RNG is not touched. A pass is one epoch; its
    incomplete last group is dropped.

    Resume rule: an iteration that starts at the step after the last one read (the next Lightning
    epoch, or a batch limit) continues the live reader. Any other start (a new process, a resume, a
    resize) replays the stream from pass 0 and skips the samples of the ``first_step()`` steps
    already taken: it reads, without collating, every sample up to that point on every rank, so its
    cost grows with the steps done. An iteration never starts with an empty pass.
    """

    def __init__(
        self,
        data: TrainingData,
        *,
        global_batch_size: int,
        dp_size: int,
        dp_rank: int,
        collate: Callable[[list[Any]], MicroBatches],
        seed: int,
        first_step: Callable[[], int],
        shares: tuple[int, ...] | ShareSchedule | None = None,
    ) -> None:
        self.data = data
        self.global_batch_size, self.dp_size, self.dp_rank = global_batch_size, dp_size, dp_rank
        self.schedule = ShareSchedule.of(shares)
        self.collate, self.seed, self.first_step = collate, seed, first_step
        self._reader: _StreamReader | None = None

    def __iter__(self) -> Iterator[MicroBatches]:
        step = self.first_step()
        if self._reader is None or step < self._reader.step:
            self._reader = _StreamReader(self.data, self.global_batch_size, self.seed)
        reader = self._reader
        while reader.step < step:
            reader.next_group(may_end_pass=False)
        yielded = 0
        while True:
            shares = self.schedule.at(reader.step)  # the global step of the group read next
            group = reader.next_group(may_end_pass=yielded > 0)
            if group is None:
                return
            yielded += 1
            yield self.collate(rank_share(group, self.dp_size, self.dp_rank, shares))


class _StreamReader:
    """One reading of the stream: the pass, its live sample iterator and the global step of the next group.

    It holds no reference back to its :class:`StreamSteps`: a reference cycle would leave a replaced
    reader's worker processes to the garbage collector, whose shutdown then waits for their timeouts.
    """

    def __init__(self, data: TrainingData, global_batch_size: int, seed: int) -> None:
        self.data, self.global_batch_size, self.seed = data, global_batch_size, seed
        self.step = 0
        self._start_pass(0)

    def _start_pass(self, index: int) -> None:
        data = self.data
        self.pass_index, self.pass_steps = index, 0
        self.rngs = _PrivateRngs(_mix(self.seed, "stream", index))
        workers = torch.Generator().manual_seed(_mix(self.seed, "workers", index))
        options = data.options.kwargs() | {"pin_memory": False}  # the finished step batch is pinned
        if data.options.num_workers:
            options["persistent_workers"] = False  # fresh workers see set_epoch and are seeded for this pass
        with self.rngs.active():
            set_epoch = getattr(data.dataset, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(index)
            loader = DataLoader(data.dataset, batch_size=None, collate_fn=_as_is, generator=workers, **options)
            self.samples: Iterator[Any] | None = iter(loader)

    def next_group(self, *, may_end_pass: bool) -> list[Any] | None:
        """The next step's global samples; at the end of a pass None where ``may_end_pass``, else the next pass's first."""
        size = self.global_batch_size
        while True:
            if self.samples is None:
                if may_end_pass:
                    return None
                self._start_pass(self.pass_index + 1)
            with self.rngs.active():
                group = list(islice(self.samples, size))  # type: ignore[arg-type]
            if len(group) == size:
                self.step += 1
                self.pass_steps += 1
                return group
            self.samples = None  # the incomplete tail is dropped; the workers stop
            if self.pass_steps == 0:
                raise FleetError(
                    f"the training stream yielded {len(group)} samples in pass {self.pass_index}, fewer than one global batch "
                    f"of {size}: lower the global batch size or add data"
                )
