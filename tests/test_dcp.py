"""The torch runtime's torch.distributed.checkpoint saves (runtime/torch/dcp.py): a round trip in one process, an FSDP2
save of 2 processes on gloo resharded into one plain model, and every byte read back going through the restricted
unpickler: planted payloads in ``.metadata`` and in a ``.distcp`` item run nothing (and do run when torch's DCP reader
loads them, proven in a subprocess), a verified checkpoint's changed or unlisted file is refused, and a tripwire proves
that nothing is unpickled outside the restricted loader.

One process and torch only, but for the resharding test (2 processes under torchrun, tests/workers/dcp_fsdp.py).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from lightning_fleet.elastic import layout, safe_load
from lightning_fleet.elastic.checkpoint import VerifiedCheckpoint, file_table
from lightning_fleet.elastic.layout import Manifest
from lightning_fleet.elastic.safe_load import ALLOWED_GLOBALS, load_dcp_metadata, unpickles
from lightning_fleet.elastic.worker import is_deterministic
from lightning_fleet.planning import FleetError
from lightning_fleet.runtime.torch.dcp import load_state, read_full, save_state
from tests.multiprocess import ROOT, run, worker_env
from tests.workers.dcp_fsdp import tiny

DATA = "__0_0.distcp"
"""The data file a one-process save writes."""


# --- helpers -----------------------------------------------------------------------------------------------------------


class Payload:
    """Runs ``touch marker`` when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A tiny model and its Adam optimizer after one step."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def fresh(seed: int = 7) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    """Another model and optimizer (other weights, another lr) and the state dict DCP loads into in place."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return model, optimizer, {"model": model_state, "optimizer": optimizer_state}


def saved(directory: Path, **extra) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Save a trained model's and optimizer's state (and ``extra`` entries) into ``directory``."""
    model, optimizer = trained()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    save_state(directory, {"model": model_state, "optimizer": optimizer_state, **extra})
    return model, optimizer


def verified(step: Path) -> VerifiedCheckpoint:
    """The step dir as a verified checkpoint, its manifest listing its files as they are now."""
    manifest = Manifest(step=1, world_size=1, plan=None, global_batch_size=None, model=None, data_seed=0, files=file_table(step))
    return VerifiedCheckpoint(step, manifest)


def one_line(error: pytest.ExceptionInfo, *words: str, refusal: bool = True) -> str:
    """The error's text, after checking it is one line holding ``words``, raised without a chained traceback, and
    deterministic when it is a refusal."""
    text = str(error.value)
    assert "\n" not in text and all(word in text for word in words), text
    assert error.value.__cause__ is None and (error.value.__context__ is None or error.value.__suppress_context__)
    assert is_deterministic(error.value) is refusal, text
    return text


def runs_under_torchs_reader(directory: Path, state_code: str) -> None:
    """Load ``directory`` with torch's own DCP reader and planner in a subprocess (the proof a payload is real)."""
    code = (f"import torch.distributed.checkpoint as dcp\nstate = {state_code}\ntry:\n"
            f"    dcp.load(state, checkpoint_id={str(directory)!r}, no_dist=True)\nexcept BaseException:\n    pass\n")
    subprocess.run([sys.executable, "-c", code], timeout=120, check=True, capture_output=True)


# --- round trips -------------------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_a_round_trip_in_one_process_restores_weights_and_optimizer_and_read_full_gives_them(tmp_path, capfd):
    model, optimizer = saved(tmp_path / "state")
    assert sorted(os.listdir(tmp_path / "state")) == [layout.DCP_METADATA, DATA]
    other, other_optimizer, state = fresh()
    assert not torch.equal(other.weight, model.weight)
    load_state(tmp_path / "state", state, checkpoint=None)
    set_state_dict(other, other_optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)
    assert other_optimizer.param_groups[0]["lr"] == 0.01
    for before, after in zip(optimizer.state_dict()["state"].values(), other_optimizer.state_dict()["state"].values()):
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    full = read_full(tmp_path / "state")
    assert torch.equal(full["model"]["weight"], model.weight) and torch.equal(full["model"]["bias"], model.bias)
    assert torch.equal(full["optimizer"]["state"]["weight"]["exp_avg"], optimizer.state[model.weight]["exp_avg"])
    assert full["optimizer"]["param_groups"][0]["lr"] == 0.01 and full["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert "distributed is disabled" not in capfd.readouterr().err  # one process was asked for: no warning about it


@pytest.mark.multiprocess
def test_an_fsdp2_save_of_two_processes_loads_into_one_plain_model(tmp_path):
    """2 ranks save an FSDP2-sharded model and Adam (uneven shards) and load it back sharded (the collective path); one
    process loads the same save into a plain model: its weights and moments are the gathered ones, as read_full's."""
    out, directory = tmp_path / "out.pt", tmp_path / "state"
    env = {**worker_env(tmp_path), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={env['MASTER_PORT']}", str(ROOT / "tests" / "workers" / "dcp_fsdp.py"),
           "--dir", str(directory), "--out", str(out)]
    done = run(cmd, env, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:]
    assert sorted(os.listdir(directory)) == [layout.DCP_METADATA, "__0_0.distcp", "__1_0.distcp"]
    result = torch.load(out, weights_only=True)
    gathered, moments = result["saved"], result["saved_optimizer"]
    assert all(torch.equal(result["loaded"][k], v) for k, v in gathered.items())  # 2 -> 2
    assert all(torch.equal(result["loaded_optimizer"][k][m], v[m]) for k, v in moments.items() for m in v)

    model = tiny(seed=5)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.3)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    load_state(directory, state, checkpoint=None)  # 2 -> 1
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    assert gathered.keys() == model.state_dict().keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in gathered.items())
    reloaded = get_state_dict(model, optimizer)[1]["state"]
    assert all(torch.equal(reloaded[k][m], v[m]) for k, v in moments.items() for m in v)
    assert optimizer.param_groups[0]["lr"] == 0.01
    full = read_full(directory)
    assert all(torch.equal(full["model"][k], v) for k, v in gathered.items())
    assert all(torch.equal(full["optimizer"]["state"][k][m], v[m]) for k, v in moments.items() for m in v)


# --- planted payloads --------------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_a_planted_metadata_runs_nothing(tmp_path, capfd):
    """A ``.metadata`` rewritten as a pickle that calls os.system: torch's reader runs it; load_state and read_full
    refuse it in one line, and nothing runs."""
    directory, marker = tmp_path / "state", tmp_path / "ran"
    saved(directory)
    (directory / layout.DCP_METADATA).write_bytes(pickle.dumps(Payload(marker)))
    runs_under_torchs_reader(directory, "{}")
    assert marker.exists()
    marker.unlink()
    with pytest.raises(FleetError) as refused:
        load_state(directory, fresh()[2], checkpoint=None)
    one_line(refused, "it would import posix.system when loaded", str(directory / layout.DCP_METADATA))
    with pytest.raises(FleetError) as refused:
        read_full(directory)
    one_line(refused, "it would import posix.system when loaded")
    assert not marker.exists()
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.unit
def test_a_planted_value_in_a_data_file_runs_nothing(tmp_path, capfd):
    """A saved plain value whose pickle calls os.system (DCP pickles it at save time, as a bytes item of the data file):
    torch's planner runs it; load_state and read_full refuse it in one line naming the item, and nothing runs."""
    directory, marker = tmp_path / "state", tmp_path / "ran"
    saved(directory, extra={"note": Payload(marker)})
    assert not marker.exists()
    runs_under_torchs_reader(directory, "{'extra': {'note': None}}")
    assert marker.exists()
    marker.unlink()
    state = {**fresh()[2], "extra": {"note": None}}
    with pytest.raises(FleetError) as refused:
        load_state(directory, state, checkpoint=None)
    one_line(refused, "DCP item extra.note of", DATA, "it would import posix.system when loaded")
    with pytest.raises(FleetError) as refused:
        read_full(directory)
    one_line(refused, "DCP item extra.note of", "it would import posix.system")
    assert not marker.exists() and state["extra"]["note"] is None
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.unit
def test_a_metadata_pointing_outside_its_directory_or_holding_other_globals_is_refused(tmp_path):
    """The metadata's own records are checked: a data file path leading out of the save dir, or a global beyond DCP's
    records (here a module class in the planner data), is refused in one line."""
    directory = tmp_path / "state"
    saved(directory)
    path = directory / layout.DCP_METADATA
    metadata = load_dcp_metadata(path)
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../../secrets.distcp"
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(FleetError) as refused:
        read_full(directory)
    one_line(refused, "'../../secrets.distcp', not in a .distcp file of the save dir")
    info.relative_path = DATA
    metadata.planner_data["model.weight"] = (torch.nn.Linear,)
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(FleetError) as refused:
        load_state(directory, fresh()[2], checkpoint=None)
    one_line(refused, "it would import torch.nn.modules.linear.Linear when loaded")


@pytest.mark.pure
def test_dcp_files_have_their_own_kinds_and_the_metadata_admits_only_dcps_records():
    assert layout.kind_of("state/.metadata") == layout.KIND_DCP_METADATA
    assert layout.kind_of("state/__1_0.distcp") == layout.KIND_DCP_DATA == layout.kind_of("__12_3.distcp")
    assert layout.kind_of("state/.distcp") == layout.kind_of("state/metadata") == layout.KIND_DATA
    assert {layout.KIND_DCP_METADATA, layout.KIND_DCP_DATA} <= set(layout.FILE_KINDS)
    dcp_names = {f"torch.distributed.checkpoint.metadata.{name}" for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "MetadataIndex",
        "StorageMeta", "TensorProperties", "_MEM_FORMAT_ENCODING")}
    expected = dcp_names | {"torch.distributed.checkpoint.filesystem._StorageInfo", "torch.serialization._get_layout",
                            "torch.Size", "pathlib.PosixPath"}
    assert set(ALLOWED_GLOBALS[layout.KIND_DCP_METADATA]) == expected
    assert ALLOWED_GLOBALS[layout.KIND_DCP_DATA] == ()


# --- a verified checkpoint's files -------------------------------------------------------------------------------------


@pytest.mark.unit
def test_a_verified_checkpoint_loads_and_refuses_a_data_file_changed_after_its_manifest(tmp_path):
    step = tmp_path / layout.step_dir_name(1)
    model, _ = saved(step / layout.STATE)
    checkpoint = verified(step)
    assert torch.equal(read_full(step / layout.STATE, checkpoint=checkpoint)["model"]["weight"], model.weight)
    data = step / layout.STATE / DATA
    content = bytearray(data.read_bytes())
    content[len(content) // 2] ^= 0xFF
    data.write_bytes(bytes(content))
    with pytest.raises(FleetError) as refused:
        load_state(step / layout.STATE, fresh()[2], checkpoint=checkpoint)
    one_line(refused, str(data), "does not match its manifest's sha256", refusal=False)
    with pytest.raises(FleetError) as refused:
        read_full(step / layout.STATE, checkpoint=checkpoint)
    one_line(refused, "does not match its manifest's sha256", refusal=False)


@pytest.mark.unit
@pytest.mark.parametrize("change", ["a file added", "a file left out of the manifest", "a data file made a link"])
def test_a_verified_checkpoint_refuses_a_file_its_manifest_does_not_list(tmp_path, change):
    step = tmp_path / layout.step_dir_name(1)
    saved(step / layout.STATE)
    checkpoint = verified(step)
    data = step / layout.STATE / DATA
    if change == "a file added":
        (step / layout.STATE / "__1_0.distcp").write_bytes(data.read_bytes())
        words = ("state/__1_0.distcp is not listed in the manifest",)
    elif change == "a file left out of the manifest":
        files = {k: v for k, v in checkpoint.manifest.files.items() if k != f"state/{DATA}"}
        checkpoint = VerifiedCheckpoint(step, Manifest(step=1, world_size=1, plan=None, global_batch_size=None, model=None,
                                                       data_seed=0, files=files))
        words = (f"state/{DATA} is not listed in the manifest",)
    else:
        copy = tmp_path / "copy.distcp"
        copy.write_bytes(data.read_bytes())
        data.unlink()
        data.symlink_to(copy)
        words = ("missing or a symbolic link",)
    for read in (lambda: load_state(step / layout.STATE, fresh()[2], checkpoint=checkpoint),
                 lambda: read_full(step / layout.STATE, checkpoint=checkpoint)):
        with pytest.raises(FleetError) as refused:
            read()
        one_line(refused, *words, refusal=change != "a data file made a link")


@pytest.mark.unit
def test_a_truncated_data_file_or_metadata_is_one_line(tmp_path):
    directory = tmp_path / "state"
    saved(directory)
    data = directory / DATA
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(FleetError) as damaged:
        load_state(directory, fresh()[2], checkpoint=None)
    one_line(damaged, "truncated", refusal=False)
    metadata = directory / layout.DCP_METADATA
    metadata.write_bytes(metadata.read_bytes()[:100])
    with pytest.raises(FleetError) as damaged:
        read_full(directory)
    one_line(damaged, str(metadata), "it is damaged, or was not written by torch.distributed.checkpoint")


@pytest.mark.unit
def test_a_state_unlike_the_saved_one_is_one_line(tmp_path, capfd):
    """DCP's own failure (a shape that differs, inside its gathered CheckpointException) is one line naming the rank."""
    directory = tmp_path / "state"
    saved(directory)
    model = torch.nn.Linear(4, 5)
    with pytest.raises(FleetError) as refused:
        load_state(directory, {"model": model.state_dict()}, checkpoint=None)
    one_line(refused, f"cannot load the DCP checkpoint in {directory} (rank 0: ValueError: Size mismatch", "the state differs")
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.unit
def test_rank_zeros_precheck_unpickles_a_steps_dcp_metadata(tmp_path):
    """unpickles() (run by rank 0 before any rank loads) checks a step's DCP metadata with the restricted unpickler."""
    step = tmp_path / layout.step_dir_name(1)
    saved(step / layout.STATE)
    manifest = verified(step).manifest
    unpickles(step, manifest.files, manifest.kinds)
    marker = tmp_path / "ran"
    (step / layout.STATE / layout.DCP_METADATA).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(FleetError) as refused:
        unpickles(step, manifest.files, manifest.kinds)
    one_line(refused, "it would import posix.system")
    assert not marker.exists()


# --- the tripwire ------------------------------------------------------------------------------------------------------


class Tripped(Exception):
    """A load outside the restricted unpickler."""


@pytest.fixture
def tripwire(monkeypatch):
    """pickle's Unpickler, load and loads, and torch.load without our restricted pickle module raise :class:`Tripped`
    (each call recorded)."""
    calls: list[str] = []

    def trip(name):
        def tripped(*args, **kwargs):
            calls.append(name)
            raise Tripped(name)
        return tripped

    torch_load = torch.load

    def guarded_load(*args, **kwargs):
        if isinstance(kwargs.get("pickle_module"), safe_load._PickleModule):
            return torch_load(*args, **kwargs)
        return trip("torch.load")(*args, **kwargs)

    monkeypatch.setattr(pickle, "Unpickler", trip("pickle.Unpickler"))
    monkeypatch.setattr(pickle, "load", trip("pickle.load"))
    monkeypatch.setattr(pickle, "loads", trip("pickle.loads"))
    monkeypatch.setattr(torch, "load", guarded_load)
    monkeypatch.setattr(torch.serialization, "load", guarded_load)
    return calls


@pytest.mark.unit
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_nothing_is_unpickled_outside_the_restricted_loader(tmp_path, tripwire):
    """Under the tripwire, torch's own DCP load trips it at once; load_state and read_full (with and without a
    manifest) load everything and trip nothing."""
    step = tmp_path / layout.step_dir_name(1)
    directory = step / layout.STATE
    model, optimizer = saved(directory, extra={"note": "plain", "sizes": [1, 2.5, None, True]})
    checkpoint = verified(step)
    with pytest.raises(BaseException):  # noqa: B017 -- torch's reader fails inside DCP's CheckpointException
        dcp.load({"extra": {"note": None}}, checkpoint_id=directory, no_dist=True)
    assert tripwire == ["pickle.load"]
    tripwire.clear()
    for manifest in (None, checkpoint):
        other, other_optimizer, state = fresh()
        state["extra"] = {"note": None, "sizes": None}
        load_state(directory, state, checkpoint=manifest)
        set_state_dict(other, other_optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        assert torch.equal(other.weight, model.weight) and state["extra"] == {"note": "plain", "sizes": [1, 2.5, None, True]}
        full = read_full(directory, checkpoint=manifest)
        assert torch.equal(full["optimizer"]["state"]["bias"]["exp_avg_sq"], optimizer.state[model.bias]["exp_avg_sq"])
    assert tripwire == []
