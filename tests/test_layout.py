"""Tier 1 (pure, no torch): the checkpoint layout's names, the typed manifest and its verification on tiny fake checkpoints.

The names are pinned to their literal values: they are the on-disk format of every checkpoint written so far.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import pickle
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_fleet.elastic import layout
from lightning_fleet.elastic.checkpoint import VerifiedCheckpoint, accept, file_table, newest_verified
from lightning_fleet.elastic.layout import (
    MANIFEST,
    FileEntry,
    Manifest,
    ManifestError,
    ModelFacts,
    TensorFact,
    Verdict,
    verify,
)
from lightning_fleet.planning import FleetError
from tests.multiprocess import ROOT

PLAN = "dp=2,tp=1,pp=1,zero=2,mbs=2,gas=2,recompute=none,sp=false,vpp=1,offload=none"
SHA = "0" * 63 + "1"
pytestmark = pytest.mark.pure

MODEL = ModelFacts(sha256="ab" * 32, tensors=(TensorFact("w", (4, 2), "float32"), TensorFact("step", (), "int64")))


def manifest(**changes) -> Manifest:
    files = {"rank-00000.pt": FileEntry(bytes=3, sha256=SHA), "state/checkpoint/x.pt": FileEntry(bytes=0, sha256=SHA)}
    fields = dict(step=12, world_size=2, plan=PLAN, global_batch_size=8, model=MODEL, data_seed=0, files=files)
    return Manifest(**{**fields, **changes})


# --- names -------------------------------------------------------------------------------------------------------


def test_names_are_the_on_disk_format():
    names = (layout.LATEST, layout.MANIFEST, layout.SET_ASIDE, layout.STATE, layout.TAG, layout.DEEPSPEED_LATEST)
    assert names == ("latest", "manifest.json", "set-aside", "state", "checkpoint", "latest")
    assert (layout.EXPORT_LAYOUT, layout.UNSTAGED) == ("fleet_layout.json", "fleet_unstaged.pt")
    assert (layout.UNIVERSAL, layout.UNIVERSAL_LATEST, layout.IMPORTED) == ("universal", "latest_universal", "imported")
    assert layout.DERIVED == ("universal", "imported") and layout.imported_dir(Path("/c/step-000000012")) == Path("/c/step-000000012/imported")
    step = Path("/ckpt/step-000000012")
    assert layout.step_dir_name(12) == step.name
    assert layout.state_dir(step) == step / "state" and layout.deepspeed_files(step) == step / "state" / "checkpoint"
    assert layout.rank_file(step, 3) == step / "rank-00003.pt" and layout.rank_file_name(12345) == "rank-12345.pt"
    assert layout.universal_dir(step) == step / "universal"
    assert layout.tmp_name(step.name) == ".tmp-step-000000012" and layout.tmp_name(layout.UNIVERSAL) == ".tmp-universal"
    assert fnmatch.fnmatch(layout.tmp_name(step.name), layout.ABANDONED_GLOB)
    assert not fnmatch.fnmatch(layout.tmp_name(layout.UNIVERSAL), layout.ABANDONED_GLOB)


@pytest.mark.parametrize(
    "name,step",
    [("step-000000012", 12), ("step-000000000", 0), ("step-12", None), (".tmp-step-000000012", None), ("latest", None)],
)
def test_step_of_parses_only_committed_names(name, step):
    assert layout.step_of(name) == step
    if step is not None:
        assert layout.step_dir_name(step) == name


@pytest.mark.parametrize("module", ["layout", "checkpoint"])
def test_layout_and_checkpoint_import_neither_torch_nor_deepspeed(module):
    """Their own imports: the stdlib, the pure planning core and (checkpoint) the layout."""
    tree = ast.parse((ROOT / "lightning_fleet" / "elastic" / f"{module}.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    package = {name for name in imported if name.startswith("lightning_fleet")}
    assert package <= {"lightning_fleet.planning", "lightning_fleet.elastic.layout"}, package
    assert all((name.split(".")[0] in sys.stdlib_module_names) for name in imported - package), imported


# --- the manifest ------------------------------------------------------------------------------------------------


def test_manifest_round_trips_and_its_json_is_what_was_always_written():
    m = manifest()
    assert Manifest.from_json(m.to_json()) == m
    # the writer before the typed manifest: json.dumps({**meta, "files": files}, indent=1, sort_keys=True)
    old = {"format": 1, "step": 12, "world_size": 2, "plan": PLAN, "global_batch_size": 8, "data_seed": 0,
           "model": {"sha256": "ab" * 32, "tensors": [["w", [4, 2], "float32"], ["step", [], "int64"]]},
           "files": {"rank-00000.pt": {"bytes": 3, "sha256": SHA}, "state/checkpoint/x.pt": {"bytes": 0, "sha256": SHA}}}
    # ... plus, since issue 22 item 11, what each file must hold (a manifest written before reads as its names say)
    assert m.to_json() == json.dumps({**old, "kinds": {"rank-00000.pt": "rng", "state/checkpoint/x.pt": "data"}}, indent=1, sort_keys=True)
    assert Manifest.from_json(json.dumps(old, indent=1, sort_keys=True).encode()) == m


def test_facts_not_recorded_are_absent_from_the_json():
    m = manifest(model=None, data_seed=None, plan=None, global_batch_size=None)
    data = json.loads(m.to_json())
    assert "model" not in data and "data_seed" not in data and data["plan"] is None and data["global_batch_size"] is None
    assert Manifest.from_json(m.to_json()) == m


def test_manifest_is_a_value():
    m = manifest()
    files = {"a.pt": FileEntry(bytes=1, sha256=SHA)}
    copied = replace(m, files=files)
    files["b.pt"] = FileEntry(bytes=2, sha256=SHA)
    assert list(copied.files) == ["a.pt"]  # the caller's dict does not reach into the manifest
    assert pickle.loads(pickle.dumps(m)) == m  # it travels in a broadcast
    with pytest.raises(AttributeError):
        m.step = 3  # type: ignore[misc]
    assert hash(m) == hash(manifest())


def _text(**changes) -> str:
    data = json.loads(manifest().to_json())
    for key, value in changes.items():
        if value is _DROP:
            data.pop(key)
        else:
            data[key] = value
    return json.dumps(data)


_DROP = object()
_ENTRY = {"bytes": 3, "sha256": SHA}


@pytest.mark.parametrize(
    "text,words",
    [
        ("{not json", "manifest is not valid JSON (Expecting property name enclosed in double quotes at line 1 column 2)"),
        (b"\xff\xfe\x00garbage", "manifest is not valid JSON ("),
        ("", "manifest is not valid JSON (Expecting value at line 1 column 1)"),
        ("[1, 2]", "manifest is a JSON array, expected an object"),
        (_text(format=_DROP), "manifest has no 'format' field"),
        (_text(format=2), "manifest has format 2; this lightning_fleet reads format 1"),
        (_text(format="1"), "manifest field 'format' is '1' (string), expected an integer"),
        (_text(extra=1), "manifest has unknown field 'extra'"),
        (_text(step=_DROP), "manifest has no 'step' field"),
        (_text(world_size=_DROP), "manifest has no 'world_size' field"),
        (_text(plan=_DROP), "manifest has no 'plan' field"),
        (_text(global_batch_size=_DROP), "manifest has no 'global_batch_size' field"),
        (_text(files=_DROP), "manifest has no 'files' field"),
        (_text(step="12"), "manifest field 'step' is '12' (string), expected an integer"),
        (_text(step=True), "manifest field 'step' is True (boolean), expected an integer"),
        (_text(step=-1), "manifest field 'step' is -1, expected at least 0"),
        (_text(world_size=0), "manifest field 'world_size' is 0, expected at least 1"),
        (_text(world_size=2.0), "manifest field 'world_size' is 2.0 (number), expected an integer"),
        (_text(plan=3), "manifest field 'plan' is 3 (number), expected a string"),
        (_text(global_batch_size="8"), "manifest field 'global_batch_size' is '8' (string), expected an integer"),
        (_text(global_batch_size=0), "manifest field 'global_batch_size' is 0, expected at least 1"),
        (_text(data_seed=None), "manifest field 'data_seed' is None (null), expected an integer"),
        (_text(files=[]), "manifest field 'files' is a JSON array, expected an object"),
        (_text(files={"a.pt": [3, SHA]}), "manifest entry for file 'a.pt' is a JSON array, expected an object"),
        (_text(files={"a.pt": {"bytes": 3}}), "entry for file 'a.pt' has fields ['bytes'], expected ['bytes', 'sha256']"),
        (_text(files={"a.pt": {"bytes": "3", "sha256": SHA}}), "manifest entry for file 'a.pt' has bytes='3', sha256="),
        (_text(files={"a.pt": {"bytes": -3, "sha256": SHA}}), "manifest entry for file 'a.pt' has bytes=-3, sha256="),
        (_text(files={"a.pt": {"bytes": 3, "sha256": "zz"}}), "manifest entry for file 'a.pt' has bytes=3, sha256='zz'"),
        (_text(files={"../../etc/passwd": _ENTRY}), "lists file '../../etc/passwd', which is not a file inside the checkpoint"),
        (_text(files={"/etc/passwd": _ENTRY}), "manifest lists file '/etc/passwd', which is not a file inside the checkpoint"),
        (_text(files={MANIFEST: _ENTRY}), "manifest lists file 'manifest.json', which is not a file inside the checkpoint"),
        (_text(model="abc"), "manifest field 'model' is a JSON string, expected an object"),
        (_text(model={"sha256": "ab"}), "field 'model' is not {'sha256': <hex>, 'tensors': [[name, [shape...], dtype], ...]}"),
        (_text(model={"sha256": "ab", "tensors": [["w", "4x2", "fp32"]]}), "field 'model' lists tensor ['w', '4x2', 'fp32']"),
        (_text(model={"sha256": "ab", "tensors": [["w", [4]]]}), "manifest field 'model' lists tensor ['w', [4]], expected"),
    ],
)
def test_every_malformed_manifest_names_what_is_wrong(text, words):
    with pytest.raises(ManifestError) as err:
        Manifest.from_json(text)
    message = str(err.value)
    assert words in message and "\n" not in message
    assert isinstance(err.value, FleetError)


# --- verification on a tiny fake checkpoint ----------------------------------------------------------------------


def fake_checkpoint(dirpath: Path, step: int) -> Path:
    """A step dir with two 'shards' and an RNG file, committed with its manifest."""
    root = dirpath / layout.step_dir_name(step)
    layout.deepspeed_files(root).mkdir(parents=True)
    (layout.deepspeed_files(root) / "mp_rank_00_model_states.pt").write_bytes(pickle.dumps({"module": os.urandom(3000)}))
    (layout.state_dir(root) / layout.DEEPSPEED_LATEST).write_text(layout.TAG)
    layout.rank_file(root, 0).write_bytes(pickle.dumps({"rng": [1, 2, 3]}))
    m = Manifest(step=step, world_size=1, plan=PLAN, global_batch_size=8, model=None, data_seed=0, files=file_table(root))
    (root / MANIFEST).write_text(m.to_json())
    return root


def test_a_whole_checkpoint_verifies_and_carries_its_manifest(tmp_path):
    root = fake_checkpoint(tmp_path, 4)
    verdict = verify(root)
    assert verdict == Verdict(root, True, "", Manifest.from_json((root / MANIFEST).read_text()))
    assert sorted(verdict.manifest.files) == ["rank-00000.pt", "state/checkpoint/mp_rank_00_model_states.pt", "state/latest"]
    rng = root / "rank-00000.pt"
    assert verdict.manifest.files["rank-00000.pt"] == FileEntry(bytes=rng.stat().st_size, sha256=layout.sha256_of(rng))


SHARD = "state/checkpoint/mp_rank_00_model_states.pt"


def _truncate(path: Path, size: int = 1000) -> None:
    assert path.stat().st_size > size
    path.write_bytes(path.read_bytes()[:size])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda root: (root / SHARD).unlink(), f"file {SHARD} is missing"),
        (lambda root: _truncate(root / SHARD),
         f"file {SHARD} has 1000 bytes, the manifest says {{size}} (truncated or overwritten)"),
        (lambda root: _flip(root / SHARD), f"file {SHARD} does not match its sha256 (corrupted)"),
    ],
    ids=["missing", "truncated", "flipped"],
)
def test_a_damaged_file_is_named_and_the_manifest_kept(tmp_path, damage, reason):
    root = fake_checkpoint(tmp_path, 4)
    size = (root / SHARD).stat().st_size
    damage(root)
    verdict = verify(root)
    assert not verdict.ok and verdict.reason == reason.format(size=size)
    assert verdict.manifest is not None and verdict.manifest.step == 4


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda root: (root / MANIFEST).unlink(), "no manifest (the save did not finish)"),
        (lambda root: _truncate(root / MANIFEST, 200), "manifest is not valid JSON ("),
        (lambda root: (root / MANIFEST).write_text(_text(world_size="2")), "manifest field 'world_size' is '2' (string)"),
        (lambda root: (root / MANIFEST).write_bytes(b"\x80" + (root / MANIFEST).read_bytes()), "manifest is not valid JSON ("),
    ],
    ids=["missing", "truncated", "ill-typed", "not-utf8"],
)
def test_a_missing_or_malformed_manifest_is_a_verdict_not_an_exception(tmp_path, damage, reason):
    root = fake_checkpoint(tmp_path, 4)
    damage(root)
    verdict = verify(root)
    assert not verdict.ok and verdict.manifest is None and verdict.reason.startswith(reason), verdict.reason


def test_newest_verified_skips_a_malformed_manifest_and_says_why(tmp_path):
    good = fake_checkpoint(tmp_path, 2)
    bad = fake_checkpoint(tmp_path, 4)
    (bad / MANIFEST).write_text(_text(files={"../x": _ENTRY}))
    logged: list[str] = []
    chosen = newest_verified(tmp_path, log=logged.append)
    assert chosen is not None and chosen.path == good and chosen.manifest.step == 2
    assert any("skipping checkpoint" in line and bad.name in line and "'../x'" in line for line in logged), logged


def test_accept_does_not_hash_again(tmp_path, monkeypatch):
    root = fake_checkpoint(tmp_path, 4)
    verdict = verify(root)
    monkeypatch.setattr(layout, "sha256_of", lambda path: pytest.fail(f"hashed {path} again"))
    assert accept(verdict) == VerifiedCheckpoint(root, verdict.manifest)


def test_accept_refuses_a_verdict_that_is_not_ok_with_its_reason(tmp_path):
    root = fake_checkpoint(tmp_path, 4)
    (root / MANIFEST).unlink()
    with pytest.raises(FleetError, match=r"step-000000004 cannot be used: no manifest \(the save did not finish\)"):
        accept(verify(root))
