"""Checkpoints that cannot run code: every pickle form the old opcode screen missed is refused by the restricted
unpickler (and each does run code when loaded the way DeepSpeed loads, proven in a subprocess); the verification
refuses symbolic links, non-regular and unlisted files, a manifest whose step is not its directory's, and checks a
derived (universal) form once it is listed; a checkpoint directory others can write is refused.

Single process, torch only (DeepSpeed's checkpoint engine class where named); the end-to-end resumes are in
tests/test_elastic.py.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
import subprocess
import sys
import threading
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lightning_fleet.elastic import layout
from lightning_fleet.elastic.checkpoint import VerifiedCheckpoint, check_private, file_table, list_derived, make_private_dir
from lightning_fleet.elastic.layout import MANIFEST, FileEntry, Manifest, verify
from lightning_fleet.elastic.safe_load import load_file
from lightning_fleet.planning import FleetError
from tests.test_layout import fake_checkpoint

pytestmark = pytest.mark.unit


# --- payloads: each writes a marker file when unpickled the unsafe way ---------------------------------------------


class Payload:
    """Runs ``touch marker`` when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _touch(marker: Path) -> bytes:
    return f"touch {marker}".encode()


def protocol0_inst(marker: Path) -> bytes:
    """Protocol 0: MARK, STRING, INST os system (the opcode the old screen did not know)."""
    return b"(S'" + _touch(marker) + b"'\nios\nsystem\n."


def stack_global_from_memo(marker: Path) -> bytes:
    """Protocol 4: the module and name of STACK_GLOBAL fetched from the memo (BINGET), not pushed just before it."""
    def short(text: bytes) -> bytes:
        return b"\x8c" + bytes([len(text)]) + text  # SHORT_BINUNICODE

    return (b"\x80\x04" + short(b"os") + b"\x94" + b"0" + short(b"system") + b"\x94" + b"0"  # MEMOIZE, POP
            + b"h\x00" + b"h\x01" + b"\x93" + short(_touch(marker)) + b"\x85" + b"R" + b".")  # BINGET, STACK_GLOBAL, TUPLE1, REDUCE


def stack_global_binstring(marker: Path) -> bytes:
    """Protocol 4: STACK_GLOBAL's operands pushed as SHORT_BINSTRING (decoded to str by pickle)."""
    def binstring(text: bytes) -> bytes:
        return b"U" + bytes([len(text)]) + text

    return b"\x80\x04" + binstring(b"os") + binstring(b"system") + b"\x93" + binstring(_touch(marker)) + b"\x85R."


def legacy_torch_file(marker: Path) -> bytes:
    """torch's legacy (non-zip) format: the payload sits in the pickle after the magic number's STOP."""
    out = io.BytesIO()
    torch.save({"weight": torch.ones(2), "hook": Payload(marker)}, out, _use_new_zipfile_serialization=False)
    return out.getvalue()


def zip_torch_file(marker: Path) -> bytes:
    """torch.save's zip archive with a __reduce__ payload in data.pkl."""
    out = io.BytesIO()
    torch.save({"weight": torch.ones(2), "hook": Payload(marker)}, out)
    return out.getvalue()


def pickle_with_zip_appended(marker: Path) -> bytes:
    """A raw pickle with a harmless zip appended: zipfile sees a zip (its directory is at the end), torch.load sees a
    legacy pickle (it looks at the start)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({"weight": [1.0]}))
    return pickle.dumps(Payload(marker), protocol=2) + out.getvalue()


PAYLOADS = {
    "protocol-0 INST": protocol0_inst,
    "STACK_GLOBAL from the memo": stack_global_from_memo,
    "STACK_GLOBAL of SHORT_BINSTRINGs": stack_global_binstring,
    "legacy torch file": legacy_torch_file,
    "torch zip with __reduce__": zip_torch_file,
    "pickle with a zip appended": pickle_with_zip_appended,
}


@pytest.mark.parametrize("form", list(PAYLOADS))
def test_a_payload_runs_when_loaded_as_deepspeed_does(tmp_path, form):
    """The proof the payloads are real: torch.load(weights_only=False), as DeepSpeed 0.19.8 loads, runs each."""
    marker, path = tmp_path / "ran", tmp_path / "payload.pt"
    path.write_bytes(PAYLOADS[form](marker))
    code = f"import torch\ntry:\n    torch.load({str(path)!r}, weights_only=False)\nexcept Exception:\n    pass\n"
    subprocess.run([sys.executable, "-c", code], timeout=120, check=True, capture_output=True)
    assert marker.exists(), form


@pytest.mark.parametrize("form", list(PAYLOADS))
def test_a_payload_is_refused_by_every_load_and_never_runs(tmp_path, form):
    """load_file (ours) and DeepSpeed's checkpoint engine as we give it to DeepSpeed refuse each form with one line,
    as a file of the most permissive kind (model states); the marker is never written."""
    from lightning_fleet.runtime.deepspeed.checked_engine import checked_engine

    marker, path = tmp_path / "ran", tmp_path / "mp_rank_00_model_states.pt"
    path.write_bytes(PAYLOADS[form](marker))
    with pytest.raises(FleetError) as refused:
        load_file(path)
    assert "\n" not in str(refused.value) and str(path) in str(refused.value)
    with pytest.raises(FleetError):
        checked_engine(None).load(str(path))
    assert not marker.exists()


def test_what_checkpoints_hold_is_admitted_per_kind(tmp_path):
    """Model states (Lightning's client state) admit the hyper-parameter values users keep; an RNG file holds only
    tensors and numbers, so a path there is refused; a file whose name no writer gives a pickle is never unpickled."""
    value = {"w": torch.arange(3.0), "shape": torch.Size([3]), "path": Path("/data"), "kept": {1, 2}}
    states = tmp_path / "mp_rank_00_model_states.pt"
    torch.save(value, states)
    loaded = load_file(states)
    assert loaded["path"] == Path("/data") and loaded["kept"] == {1, 2} and torch.equal(loaded["w"], value["w"])
    rng = tmp_path / "rank-00000.pt"
    torch.save({"w": value["w"], "path": value["path"]}, rng)
    with pytest.raises(FleetError, match=r"it would import pathlib.PosixPath when loaded, .* a rng file holds only tensors"):
        load_file(rng)
    other = tmp_path / "notes.pt"
    torch.save({"w": torch.ones(1)}, other)
    with pytest.raises(FleetError, match="its name is not that of a file lightning_fleet or DeepSpeed unpickles"):
        load_file(other)


def test_load_file_reads_once_and_checks_the_manifest_entry(tmp_path):
    path = tmp_path / "rank-00000.pt"
    torch.save({"w": torch.ones(4)}, path)
    entry = layout.entry_of(path)
    assert torch.equal(load_file(path, entry)["w"], torch.ones(4))
    torch.save({"w": torch.zeros(4)}, path)  # swapped after the verification, same size
    with pytest.raises(FleetError, match="does not match its manifest's sha256: it changed after the checkpoint was verified"):
        load_file(path, entry)
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere.pt")
    with pytest.raises(FleetError, match="missing or a symbolic link"):
        load_file(path, entry)


def test_deepspeeds_checkpoint_engine_reads_only_listed_files_of_the_checkpoint(tmp_path):
    """The engine DeepSpeed loads through (runtime/deepspeed/checked_engine.py): a listed file loads, a file outside
    the verified step dir or unlisted in it is refused, a file changed since the verification is refused."""
    from lightning_fleet.runtime.deepspeed.checked_engine import checked_engine

    step = tmp_path / "step-000000002"
    (step / "state" / "checkpoint").mkdir(parents=True)
    shard = step / "state" / "checkpoint" / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}}, shard)
    manifest = Manifest(step=2, world_size=1, plan=None, global_batch_size=None, model=None, data_seed=0, files=file_table(step))
    engine = checked_engine(VerifiedCheckpoint(step, manifest))
    assert torch.equal(engine.load(str(shard), map_location="cpu")["module"]["w"], torch.ones(2))
    outside = tmp_path / "planted.pt"
    torch.save({}, outside)
    with pytest.raises(FleetError, match="outside the verified checkpoint"):
        engine.load(str(outside))
    extra = step / "state" / "checkpoint" / "extra.pt"
    torch.save({}, extra)
    with pytest.raises(FleetError, match="does not list"):
        engine.load(str(extra))
    shard.write_bytes(zip_torch_file(tmp_path / "ran"))
    with pytest.raises(FleetError):
        engine.load(str(shard))
    assert not (tmp_path / "ran").exists()


# --- the verification: exactly the listed regular files, the step the name says ---------------------------------


def _relisted(root: Path) -> None:
    """What an attacker (or an operator) with write access does: rewrite the manifest to match the files."""
    m = Manifest.from_json((root / MANIFEST).read_bytes())
    (root / MANIFEST).write_text(replace(m, files=file_table(root)).to_json())


def test_a_symlinked_directory_inside_a_step_is_refused(tmp_path):
    root = fake_checkpoint(tmp_path / "ckpt", 4)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "payload.pt").write_bytes(protocol0_inst(tmp_path / "ran"))
    (root / "state" / "extra").symlink_to(elsewhere, target_is_directory=True)
    verdict = verify(root)
    assert not verdict.ok and verdict.reason == "state/extra is a symbolic link; a checkpoint holds only its own files"


def test_a_symlinked_file_or_step_dir_is_refused(tmp_path):
    root = fake_checkpoint(tmp_path / "ckpt", 4)
    shard = root / "rank-00000.pt"
    target = tmp_path / "real.pt"
    shard.rename(target)
    shard.symlink_to(target)
    assert "rank-00000.pt is a symbolic link" in verify(root).reason
    link = tmp_path / "ckpt" / "step-000000009"
    link.symlink_to(fake_checkpoint(tmp_path / "other", 9), target_is_directory=True)
    assert verify(link).reason == "the checkpoint directory is a symbolic link; only real directories are resumed"


def test_an_unlisted_file_is_refused_even_with_a_consistent_rest(tmp_path):
    root = fake_checkpoint(tmp_path, 4)
    (root / "state" / "notes.txt").write_text("added later")
    assert verify(root).reason == "file state/notes.txt is not listed in the manifest (added after the save)"
    _relisted(root)
    assert verify(root).ok


def test_a_fifo_in_a_step_or_as_its_manifest_never_blocks(tmp_path):
    root = fake_checkpoint(tmp_path, 4)
    os.mkfifo(root / "state" / "pipe")
    result: list[str] = []
    worker = threading.Thread(target=lambda: result.append(verify(root).reason), daemon=True)
    worker.start()
    worker.join(10)
    assert result == ["state/pipe is not a regular file (a FIFO, socket or device); a checkpoint holds only regular files"]
    (root / "state" / "pipe").unlink()
    (root / MANIFEST).unlink()
    os.mkfifo(root / MANIFEST)
    worker = threading.Thread(target=lambda: result.append(verify(root).reason), daemon=True)
    worker.start()
    worker.join(10)
    assert result[1] == "manifest is not a regular file"


def test_a_manifest_whose_step_is_not_its_directorys_is_refused(tmp_path):
    """An operator's copy (or a planted dir) named higher than the step it holds."""
    root = fake_checkpoint(tmp_path, 4)
    copy = tmp_path / layout.step_dir_name(900)
    root.rename(copy)
    assert verify(copy).reason.startswith("its manifest records step 4, not the step 900 it is named after")


def test_a_deeply_nested_or_huge_manifest_is_a_reason_not_a_crash(tmp_path):
    root = fake_checkpoint(tmp_path, 4)
    (root / MANIFEST).write_text("[" * 100000 + "]" * 100000)
    assert not verify(root).ok and "nested too deeply" in verify(root).reason
    with open(root / MANIFEST, "wb") as f:
        f.truncate(layout.MAX_MANIFEST_BYTES + 10)
    assert "larger than" in verify(root).reason


def test_the_universal_form_is_checked_once_listed_and_ignored_before(tmp_path):
    root = fake_checkpoint(tmp_path, 4)
    universal = layout.universal_dir(root) / layout.TAG
    universal.mkdir(parents=True)
    (universal / "fp32.pt").write_bytes(b"x" * 100)
    assert verify(root).ok  # a conversion that never got listed: not loaded, converted again
    manifest = list_derived(root, verify(root).manifest, layout.UNIVERSAL)
    assert manifest.files["universal/checkpoint/fp32.pt"] == FileEntry(bytes=100, sha256=layout.sha256_of(universal / "fp32.pt"))
    assert verify(root).ok and layout.derived_listed(verify(root).manifest, layout.UNIVERSAL)
    (universal / "fp32.pt").write_bytes(b"x" * 99 + b"y")  # a flipped byte after the conversion
    assert verify(root).reason == "file universal/checkpoint/fp32.pt does not match its sha256 (corrupted)"


# --- who may write the checkpoint directory ------------------------------------------------------------------------


def test_a_checkpoint_directory_others_can_write_is_refused(tmp_path):
    directory = tmp_path / "ckpt"
    make_private_dir(directory)
    check_private(directory)
    for mode, who in ((0o777, "everyone"), (0o775, "its group")):
        directory.chmod(mode)
        with pytest.raises(FleetError, match=f"writable by {who} .*chmod go-w"):
            check_private(directory)
    directory.chmod(0o755)
    link = tmp_path / "link"
    link.symlink_to(directory, target_is_directory=True)
    with pytest.raises(FleetError, match="is a symbolic link"):
        check_private(link)
    check_private(tmp_path / "not-yet")  # created privately by the first save


def test_make_private_dir_ignores_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        make_private_dir(tmp_path / "a" / "ckpt")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a" / "ckpt").stat().st_mode) & 0o022 == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_checkpoint_directory_of_another_user_is_refused(tmp_path):
    """The audit's case: `nobody` plants a checkpoint a root job would resume."""
    directory = tmp_path / "ckpt"
    directory.mkdir(mode=0o755)
    os.chown(directory, 65534, 65534)
    with pytest.raises(FleetError, match=r"belongs to uid 65534, but this job runs as uid 0"):
        check_private(directory)
