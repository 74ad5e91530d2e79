"""The training-data layer: every order source and streams give each rank its share of one global batch per step.

Samples are integer ids, so a step batch reads back as the list of ids it holds. Each "rank" is
built and driven on its own (its own loader, its own global RNG state), the way separate processes
would be; the driver re-iterates the loader when an epoch ends and reads the position from a
counter, as Lightning does with ``trainer.global_step``.
"""

from __future__ import annotations

import random
from typing import Any, Callable

import numpy
import pytest
import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    get_worker_info,
)

from lightning_fleet.data import (
    DataKind,
    OrderSource,
    SamplerOrder,
    example_batch,
    inspect_training_loader,
    step_loader,
)
from lightning_fleet.elastic.sampler import MicroBatches
from lightning_fleet.planning import FleetError
from tests.multiprocess import QUIET_TRAINER

SEED = 7
G = 8  # global batch
SPLITS = [(1, 1), (1, 4), (2, 2), (4, 1), (4, 2)]  # (dp, gas): micro-batches of 8, 2, 2, 2 and 1 samples


# --- datasets and samplers a user would write -----------------------------------------------------


class Ids(Dataset):
    """Map-style: sample ``i`` is the integer ``i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return int(i)


class GlobalRngSampler(Sampler[int]):
    """Shuffles with the global torch RNG (like SubsetRandomSampler without a generator)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())


class OwnGeneratorSampler(Sampler[int]):
    """Keeps its own torch generator and an epoch (set_epoch) that shifts its order."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0
        self.rng = torch.Generator().manual_seed(1234)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        perm = torch.randperm(self.n, generator=self.rng).tolist()
        return iter(perm[self.epoch % self.n :] + perm[: self.epoch % self.n])


class PythonRngSampler(Sampler[int]):
    """Draws from a ``random.Random`` of its own and defines no ``__len__``: every third id, shuffled."""

    def __init__(self, n: int) -> None:
        self.keys = list(range(0, n, 3))
        self.rng = random.Random(99)

    def __iter__(self):
        keys = list(self.keys)
        self.rng.shuffle(keys)
        return iter(keys)


class ShuffledStream(IterableDataset):
    """30 ids per pass, shuffled with the global torch RNG; pass ``p`` adds ``100 * p`` (from set_epoch)."""

    def __init__(self, n: int = 30) -> None:
        self.n, self.epoch = n, 0
        self.epochs_set: list[int] = []
        self.iterations = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.epochs_set.append(epoch)

    def __iter__(self):
        self.iterations += 1
        for i in torch.randperm(self.n).tolist():
            yield i + 100 * self.epoch


class WorkerStream(IterableDataset):
    """Ids 0..n-1 split between DataLoader workers by ``get_worker_info``; ``tag`` (set by a worker_init_fn) adds 1000."""

    def __init__(self, n: int) -> None:
        self.n, self.tag = n, 0

    def __iter__(self):
        info = get_worker_info()
        ids = range(self.n) if info is None else range(info.id, self.n, info.num_workers)
        for i in ids:
            yield i + 1000 * self.tag


def tag_worker(worker_id: int) -> None:
    """A worker_init_fn: marks the worker's copy of the dataset."""
    get_worker_info().dataset.tag = 1


EVENS = list(range(0, 36, 2))
SOURCES: dict[str, Callable[[], DataLoader]] = {
    "sequential": lambda: DataLoader(Ids(36), batch_size=4),
    "shuffle": lambda: DataLoader(Ids(36), batch_size=4, shuffle=True),
    "distributed": lambda: DataLoader(Ids(36), batch_size=4, sampler=DistributedSampler(Ids(36), num_replicas=2, rank=1)),
    "subset": lambda: DataLoader(Ids(36), batch_size=4, sampler=SubsetRandomSampler(EVENS)),
    "weighted": lambda: DataLoader(Ids(36), batch_size=4, sampler=WeightedRandomSampler(torch.arange(1.0, 37.0), 26)),
    "replacement": lambda: DataLoader(Ids(36), batch_size=4, sampler=RandomSampler(Ids(36), replacement=True, num_samples=20)),
    "global_rng": lambda: DataLoader(Ids(36), batch_size=4, sampler=GlobalRngSampler(36)),
    "own_generator": lambda: DataLoader(Ids(36), batch_size=4, sampler=OwnGeneratorSampler(36)),
    "python_rng": lambda: DataLoader(Ids(36), batch_size=4, sampler=PythonRngSampler(36)),
    "stream": lambda: DataLoader(ShuffledStream(), batch_size=4),
}
STEPS_PER_EPOCH = {"subset": 2, "weighted": 3, "replacement": 2, "python_rng": 1, "stream": 3}  # others: 36 // 8 = 4


# --- the driver: one rank, the way Lightning iterates ---------------------------------------------


def set_global_rngs(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)


def rng_states() -> tuple:
    np_state = numpy.random.get_state()
    return torch.get_rng_state(), random.getstate(), (np_state[0], np_state[1].tolist(), *np_state[2:])


def same_rng(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2]


def ids(micro: Any) -> list[int]:
    return micro.tolist()


def drive(loader: DataLoader, position: list[int], steps: int) -> list[list[list[int]]]:
    """The micro-batch ids of ``steps`` steps; a new iteration per epoch; ``position[0]`` counts optimizer steps."""
    out: list[list[list[int]]] = []
    while len(out) < steps:
        before = len(out)
        for batch in loader:
            assert isinstance(batch, MicroBatches)
            out.append([ids(micro) for micro in batch])
            position[0] += 1
            if len(out) == steps:
                break
        assert len(out) > before, "an epoch without a step"
    return out


def run_rank(make: Callable[[], DataLoader], *, dp: int, rank: int, gas: int, start: int, steps: int) -> list[list[list[int]]]:
    """One data-parallel rank, built in its own global RNG state from its own loader, from global step ``start``."""
    set_global_rngs(100 + 17 * rank + start)
    data = inspect_training_loader(make())
    position = [start]
    loader = step_loader(data, global_batch_size=G, dp_size=dp, dp_rank=rank, gas=gas, seed=SEED, first_step=lambda: position[0])
    return drive(loader, position, steps)


def global_batches(make: Callable[[], DataLoader], *, dp: int, gas: int, start: int = 0, steps: int = 9) -> list[list[int]]:
    """Every step's samples, the ranks' shares joined in rank order; checks the micro-batch sizes on the way."""
    ranks = [run_rank(make, dp=dp, rank=r, gas=gas, start=start, steps=steps) for r in range(dp)]
    for share in ranks:
        for step in share:
            assert [len(micro) for micro in step] == [G // dp // gas] * gas
    return [sum((sum(ranks[r][s], []) for r in range(dp)), []) for s in range(steps)]


# --- every order source -------------------------------------------------------------------------------


@pytest.mark.pure
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_the_ranks_shares_are_the_global_batch_for_every_split(source):
    reference = global_batches(SOURCES[source], dp=1, gas=1)
    for dp, gas in SPLITS[1:]:
        assert global_batches(SOURCES[source], dp=dp, gas=gas) == reference, (dp, gas)
    per_epoch = STEPS_PER_EPOCH.get(source, 4)
    epochs = [sum(reference[e * per_epoch : (e + 1) * per_epoch], []) for e in range(2)]
    if source != "sequential":  # a random order is drawn again every epoch (the distributed sampler's flag is shuffle)
        assert epochs[0] != epochs[1]


@pytest.mark.pure
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_resume_at_any_step_continues_exactly(source):
    full = global_batches(SOURCES[source], dp=2, gas=2, steps=9)
    per_epoch = STEPS_PER_EPOCH.get(source, 4)
    for start in (1, per_epoch, per_epoch + 1):  # mid-epoch, at an epoch boundary, one after it
        assert global_batches(SOURCES[source], dp=4, gas=1, start=start, steps=9 - start) == full[start:], start


@pytest.mark.pure
def test_default_orders_are_the_global_batch_samplers():
    """Identity without shuffle, ``randperm(n, Generator().manual_seed(seed + epoch))`` with it (tests/reference.py's)."""
    sequential = sum(global_batches(SOURCES["sequential"], dp=2, gas=1, steps=4), [])
    assert sequential == list(range(32))
    for source in ("shuffle", "distributed"):
        shuffled = global_batches(SOURCES[source], dp=2, gas=1, steps=8)
        for epoch in range(2):
            perm = torch.randperm(36, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
            assert sum(shuffled[4 * epoch : 4 * epoch + 4], []) == perm[:32]


@pytest.mark.pure
def test_inspect_names_the_order_source():
    expected = {
        "sequential": OrderSource.SEQUENTIAL,
        "shuffle": OrderSource.SHUFFLED,
        "distributed": OrderSource.SHUFFLED,
        "stream": OrderSource.STREAM,
    }
    for source, make in SOURCES.items():
        data = inspect_training_loader(make())
        assert data.order is expected.get(source, OrderSource.SAMPLER), source
        assert data.kind is (DataKind.STREAM if source == "stream" else DataKind.MAP)
        assert data.batch_size == 4
    unshuffled = DataLoader(Ids(8), batch_size=2, sampler=DistributedSampler(Ids(8), num_replicas=2, rank=0, shuffle=False))
    assert inspect_training_loader(unshuffled).order is OrderSource.SEQUENTIAL
    assert inspect_training_loader(SOURCES["subset"]()).sampler is not None


@pytest.mark.pure
def test_lightnings_distributed_wrapper_is_unwrapped_to_the_users_sampler():
    """Lightning's re-instantiated loader (distributed runs) wraps a custom sampler: the order is still the user's."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    subset = SubsetRandomSampler(EVENS)
    wrapper = DistributedSamplerWrapper(subset, num_replicas=2, rank=1)
    wrapped = lambda: DataLoader(Ids(36), batch_size=4, sampler=wrapper)  # noqa: E731
    assert inspect_training_loader(wrapped()).sampler is subset
    assert global_batches(wrapped, dp=2, gas=1, steps=5) == global_batches(SOURCES["subset"], dp=2, gas=1, steps=5)


@pytest.mark.pure
def test_a_subset_sampler_never_leaves_its_subset():
    data = inspect_training_loader(SOURCES["subset"]())
    assert set(ids(example_batch(data, 4))) <= set(EVENS)
    steps = global_batches(SOURCES["subset"], dp=2, gas=2, steps=6)
    for epoch in range(3):
        seen = sum(steps[2 * epoch : 2 * epoch + 2], [])
        assert len(set(seen)) == 16 and set(seen) <= set(EVENS)  # 16 of the 18, without repetition


@pytest.mark.pure
def test_the_users_sampler_generator_and_the_process_rngs_are_left_as_they_were():
    weighted = WeightedRandomSampler(torch.ones(36), 24, generator=torch.Generator().manual_seed(5))
    own = OwnGeneratorSampler(36)
    python = PythonRngSampler(36)
    for sampler in (weighted, own, python):
        loader = DataLoader(Ids(36), batch_size=4, sampler=sampler)
        generator = sampler.generator if sampler is weighted else sampler.rng
        saved_generator = generator.get_state() if isinstance(generator, torch.Generator) else generator.getstate()
        saved_attributes = dict(vars(sampler))
        set_global_rngs(3)
        before = rng_states()
        data = inspect_training_loader(loader)
        example_batch(data, 4)
        order = SamplerOrder(sampler, SEED)
        first, again = order(0), SamplerOrder(sampler, SEED)(0)
        assert first == again and order(1) != first
        assert same_rng(rng_states(), before)
        after = generator.get_state() if isinstance(generator, torch.Generator) else generator.getstate()
        assert (torch.equal(after, saved_generator) if isinstance(after, torch.Tensor) else after == saved_generator)
        assert vars(sampler) == saved_attributes


@pytest.mark.pure
def test_a_stream_consumes_no_rng_of_the_process():
    set_global_rngs(11)
    before = rng_states()
    data = inspect_training_loader(SOURCES["stream"]())
    example_batch(data, 4)
    position = [0]
    loader = step_loader(data, global_batch_size=G, dp_size=2, dp_rank=0, gas=1, seed=SEED, first_step=lambda: position[0])
    drive(loader, position, 7)
    assert same_rng(rng_states(), before)


@pytest.mark.pure
def test_example_batch_collates_the_first_samples():
    assert ids(example_batch(inspect_training_loader(SOURCES["sequential"]()), 5)) == [0, 1, 2, 3, 4]
    assert ids(example_batch(inspect_training_loader(SOURCES["shuffle"]()), 50)) == list(range(36))
    stream = example_batch(inspect_training_loader(DataLoader(WorkerStream(10), batch_size=3, num_workers=2)), 4)
    assert ids(stream) == [0, 1, 2, 3]  # read in this process, not through the user's workers


# --- streams ----------------------------------------------------------------------------------------


@pytest.mark.pure
def test_a_stream_is_read_once_per_pass_and_set_epoch_is_called():
    stream = ShuffledStream()
    data = inspect_training_loader(DataLoader(stream, batch_size=4))
    position = [0]
    loader = step_loader(data, global_batch_size=G, dp_size=1, dp_rank=0, gas=1, seed=SEED, first_step=lambda: position[0])
    steps = drive(loader, position, 9)  # three passes of three steps (six samples of each pass dropped)
    assert stream.iterations == 3 and stream.epochs_set == [0, 1, 2]
    for p in range(3):
        samples = sum((step[0] for step in steps[3 * p : 3 * p + 3]), [])
        assert len(set(samples)) == 24 and all(100 * p <= s < 100 * p + 30 for s in samples)
    resumed_stream = ShuffledStream()
    data = inspect_training_loader(DataLoader(resumed_stream, batch_size=4))
    position = [4]  # replay: pass 0 is read again, then pass 1 up to its second step
    loader = step_loader(data, global_batch_size=G, dp_size=1, dp_rank=0, gas=1, seed=SEED, first_step=lambda: position[0])
    assert drive(loader, position, 5) == steps[4:]
    assert resumed_stream.epochs_set == [0, 1, 2]


@pytest.mark.unit
def test_a_stream_with_workers_is_grouped_in_the_stream_order():
    options = {"num_workers": 2, "worker_init_fn": tag_worker, "prefetch_factor": 3}
    make = lambda: DataLoader(WorkerStream(20), batch_size=2, **options)  # noqa: E731
    reference = global_batches(make, dp=1, gas=1, steps=5)  # 2 steps per pass of 20 (4 dropped)
    expected = [[1000 + (s % 2) * 8 + i for i in range(8)] for s in range(5)]
    assert reference == expected  # in the stream's order, tagged: the worker_init_fn ran in the workers
    assert global_batches(make, dp=2, gas=2, steps=5) == reference
    assert global_batches(make, dp=4, gas=1, start=3, steps=2) == reference[3:]


@pytest.mark.pure
def test_a_stream_shorter_than_one_global_batch_is_one_line():
    data = inspect_training_loader(DataLoader(WorkerStream(5), batch_size=2))
    loader = step_loader(data, global_batch_size=G, dp_size=1, dp_rank=0, gas=1, seed=SEED, first_step=lambda: 0)
    with pytest.raises(FleetError, match="yielded 5 samples in pass 0, fewer than one global batch of 8") as err:
        next(iter(loader))
    assert "\n" not in str(err.value)


# --- loader options -------------------------------------------------------------------------------


@pytest.mark.pure
def test_loader_options_are_carried_over():
    def init(worker_id: int) -> None:
        """A worker_init_fn that is compared, not run (the workers test runs one)."""

    user = DataLoader(
        Ids(36),
        batch_size=4,
        shuffle=True,
        num_workers=2,
        pin_memory=True,
        worker_init_fn=init,
        persistent_workers=True,
        multiprocessing_context="spawn",
        prefetch_factor=3,
        timeout=7.0,
        generator=torch.Generator().manual_seed(3),
    )
    data = inspect_training_loader(user)
    loader = step_loader(data, global_batch_size=G, dp_size=2, dp_rank=0, gas=2, seed=SEED, first_step=lambda: 0)
    for name in ("num_workers", "pin_memory", "worker_init_fn", "persistent_workers", "multiprocessing_context"):
        assert getattr(loader, name) == getattr(user, name), name
    assert (loader.prefetch_factor, loader.timeout) == (user.prefetch_factor, user.timeout) == (3, 7.0)
    assert loader.generator is not user.generator  # the order is the strategy's; the user's generator is not consumed
    assert len(loader) == 4
    stream = step_loader(
        inspect_training_loader(DataLoader(ShuffledStream(), batch_size=4, pin_memory=True)),
        global_batch_size=G,
        dp_size=1,
        dp_rank=0,
        gas=1,
        seed=SEED,
        first_step=lambda: 0,
    )
    assert stream.pin_memory and stream.num_workers == 0  # the user's workers read the stream inside (see the workers test)


# --- refusals: one line each -----------------------------------------------------------------------


class Keys(Dataset):
    """A map-style dataset without __len__."""

    def __getitem__(self, key: int) -> int:
        return key


class Uncopyable(Sampler[int]):
    def __init__(self) -> None:
        self.items = [1, 2, 3]

    def __iter__(self):
        return iter(self.items)

    def __reduce_ex__(self, protocol):
        raise TypeError("no copies")


class Growing(Sampler[int]):
    """Yields one key more every epoch."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(range(16 + self.epoch))


class RankSampler(DistributedSampler):
    pass


def refuse(call: Callable[[], Any], match: str) -> str:
    with pytest.raises(FleetError, match=match) as err:
        call()
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.pure
def test_what_cannot_be_honoured_is_refused_with_one_line():
    make = lambda loader: lambda: inspect_training_loader(loader)  # noqa: E731
    refuse(make([1, 2]), "one torch DataLoader, but the training data is a list")
    batches = BatchSampler(RandomSampler(Ids(8)), 2, False)
    refuse(make(DataLoader(Ids(8), batch_sampler=batches)), "custom batch_sampler .BatchSampler.")
    refuse(make(DataLoader(Ids(8), batch_size=None)), "batch_size=None.*set batch_size=")
    refuse(make(DataLoader(ShuffledStream(), batch_size=None)), "IterableDataset has batch_size=None")
    by_rank = RankSampler(Ids(8), num_replicas=2, rank=0)
    refuse(make(DataLoader(Ids(8), batch_size=2, sampler=by_rank)), "DistributedSampler subclass")
    loaders = {
        "no_len": DataLoader(Keys(), batch_size=2),
        "too_few": DataLoader(Ids(6), batch_size=2),
        "uncopyable": DataLoader(Keys(), batch_size=2, sampler=Uncopyable()),
        "growing": DataLoader(Keys(), batch_size=2, sampler=Growing()),
    }
    defaults = {"global_batch_size": G, "dp_size": 1, "dp_rank": 0, "gas": 1, "seed": 0, "first_step": lambda: 0}
    loader = lambda name, **kw: step_loader(inspect_training_loader(loaders[name]), **(defaults | kw))  # noqa: E731
    refuse(lambda: loader("no_len"), "Keys has no len")
    refuse(lambda: loader("too_few"), "6 samples per epoch, fewer than one global batch of 8")
    refuse(lambda: loader("uncopyable"), "Uncopyable cannot be copied")
    refuse(lambda: list(loader("growing", first_step=lambda: 2)), "yielded 17 keys in epoch 1, expected 16")
    refuse(lambda: loader("too_few", global_batch_size=6, dp_size=4), "does not split into dp 4 x gas 1")


# --- under Lightning's own fit loop -----------------------------------------------------------------


def recording_module(make: Callable[[], DataLoader], gas: int):
    """A LightningModule that trains from step_loader the way the strategy wires it, recording each step's ids."""
    from lightning.pytorch import LightningModule

    class Recording(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(1))
            self.seen: list[list[int]] = []

        def train_dataloader(self):
            data = inspect_training_loader(make())
            position = lambda: self.trainer.global_step  # noqa: E731 - what the strategy passes
            return step_loader(data, global_batch_size=G, dp_size=1, dp_rank=0, gas=gas, seed=SEED, first_step=position)

        def training_step(self, batch, batch_idx):
            assert isinstance(batch, MicroBatches) and len(batch) == gas
            self.seen.append(sum((ids(micro) for micro in batch), []))
            return sum((self.weight * micro.float()).mean() for micro in batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    return Recording()


def lightning_fit(module, max_steps: int, ckpt_path=None):
    from lightning.pytorch import Trainer

    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        **QUIET_TRAINER,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.unit
@pytest.mark.parametrize("source", ["subset", "stream"])
def test_lightning_trains_the_global_order_and_resumes_it(source, tmp_path):
    stream = ShuffledStream()
    make = (lambda: DataLoader(stream, batch_size=4)) if source == "stream" else SOURCES[source]
    full = recording_module(make, gas=2)
    lightning_fit(full, max_steps=7)
    if source == "stream":
        assert stream.iterations == 3  # three passes, the live reader continued across Lightning's epochs
    assert full.seen == global_batches(make, dp=1, gas=1, steps=7)  # Lightning's epochs follow the passes/epochs
    first = recording_module(make, gas=2)
    trainer = lightning_fit(first, max_steps=3)
    trainer.save_checkpoint(tmp_path / "step3.ckpt")
    resumed = recording_module(make, gas=2)
    lightning_fit(resumed, max_steps=7, ckpt_path=tmp_path / "step3.ckpt")
    assert first.seen + resumed.seen == full.seen
