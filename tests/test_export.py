"""Tier 3: weights out of any plan, and the user's module handed back intact after fit.

One 2-process job trains the example GPT under ZeRO 0, 1, 2, 3, ZeRO-3 with optimizer+parameter offload,
tensor parallel (ZeRO 0 and 3) and pipeline parallel (ZeRO 0 and 1), each also under bf16-mixed or 16-mixed
where DeepSpeed keeps fp32 masters in another place (ZeRO-0's fp16/bf16 optimizer wrapper, ZeRO-1's and the
pipeline's bf16 optimizer), TiedGPT (tied head, buffers that training changes) under ZeRO-3 and tp, and
PathGPT (a pathlib.Path hyper-parameter) under ZeRO-2; one 4-process job trains dp x tp and dp x pp. After each fit the
worker (tests/workers/export_gpt.py) gathers the live full weights, saves, restores the module, checks it
and saves again. Here: every export (FleetCheckpoint step dir, its directory, its state/ dir, the saves
before and after the restore) equals the live weights bit for bit and the one-process reference within
2e-5; the restored module is the plain original one and computes the reference's output; the exported file
loads in a process that never imports lightning_fleet; broken input is one clear error line.
"""

from __future__ import annotations

import enum
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch._utils import _flatten_dense_tensors

from examples.gpt.data import StdlibText
from examples.gpt.model import GPT
from lightning_fleet import cli
from lightning_fleet.elastic.safe_load import load_file
from lightning_fleet.elastic.layout import EXPORT_LAYOUT
from lightning_fleet.export import export_checkpoint, export_state_dict, lightning_checkpoint
from lightning_fleet.planning import FleetError
from lightning_fleet.runtime.deepspeed.reader import _wrapper_merge
from tests.hardware import needs_fp16, runs_here
from tests.multiprocess import ROOT, run, worker_env
from tests.reference import reference_run
from tests.workers.train_gpt import DATA, SIZES, eval_batch

WORKER = ROOT / "tests" / "workers" / "export_gpt.py"
STEPS, GBS = 3, 8
# Order matters within one process: DeepSpeed keeps model-parallel state after a tp or pp engine, which breaks a
# later data-parallel one ('NoneType' ... get_model_parallel_rank), so data parallel first, then tp, then pp.
PLANS = [
    "dp=2,zero=0",
    "dp=2,zero=1",
    "dp=2,zero=2",
    "path:dp=2,zero=2",
    "dp=2,zero=3",
    "dp=2,zero=3,offload=optimizer+params",
    "tied:dp=2,zero=3",
    "bf16-mixed@dp=2,zero=0",
    "16-mixed@dp=2,zero=0",
    "bf16-mixed@dp=2,zero=1",
    "dp=1,tp=2,zero=0",
    "dp=1,tp=2,zero=3",
    "tied:dp=1,tp=2,zero=1",
    "bf16-mixed@dp=1,tp=2,zero=0",
    "dp=1,pp=2,zero=0",
    "dp=1,pp=2,zero=1",
    "bf16-mixed@dp=1,pp=2,zero=0",
    "16-mixed@dp=1,pp=2,zero=0",
]
WIDE_PLANS = ["dp=2,tp=2,zero=3", "dp=2,pp=2,zero=1", "16-mixed@dp=2,pp=2,zero=0"]
LAUNCHED = {2: [p for p in PLANS if runs_here(p)], 4: [p for p in WIDE_PLANS if runs_here(p)]}
"""The plans each job trains: those this CPU runs (fp16 needs fp16 kernels, tests/hardware.py)."""
RUNS = [(2, p) for p in PLANS] + [(4, p) for p in WIDE_PLANS]
RUN_IDS = [f"{world}x-{plan}" for world, plan in RUNS]


def _params(keep) -> list:  # type: ignore[no-untyped-def]
    """The runs ``keep(plan)`` selects; one this CPU cannot train is skipped with the reason."""
    return [pytest.param(w, p, id=i, marks=() if runs_here(p) else needs_fp16) for (w, p), i in zip(RUNS, RUN_IDS) if keep(p)]


ALL_RUNS = _params(lambda plan: True)
# fp32 runs of the plain GPT (and PathGPT, the same weights): comparable with the one-process fp32 reference
GPT_RUNS = _params(lambda plan: not plan.startswith("tied:") and "@" not in plan)
MIXED_RUNS = _params(lambda plan: "@" in plan)


def _launch(tmp: Path, plans: list[str], devices: int) -> list[dict]:
    out = tmp / "results.pt"
    cmd = [sys.executable, str(WORKER), "--plans", ";".join(plans), "--steps", str(STEPS), "--gbs", str(GBS)]
    cmd += ["--devices", str(devices), "--save-to", str(tmp / "saves"), "--out", str(out)]
    if devices != 2:
        cluster = (ROOT / "lightning_fleet/planning/presets/clusters/cpu.yaml").read_text()
        (tmp / "cluster.yaml").write_text(cluster.replace("devices_per_node: 2", f"devices_per_node: {devices}"))
        cmd += ["--cluster", str(tmp / "cluster.yaml")]
    done = run(cmd, worker_env(tmp), timeout=300)
    assert done.returncode == 0, done.stdout[-6000:]
    return torch.load(out, weights_only=False)  # our own worker's file: plain tensors, lists, dicts


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[int, tuple[Path, list[dict]]]:
    """World size -> (save directory, per-plan results)."""
    narrow, wide = tmp_path_factory.mktemp("narrow"), tmp_path_factory.mktemp("wide")
    return {2: (narrow / "saves", _launch(narrow, LAUNCHED[2], 2)), 4: (wide / "saves", _launch(wide, LAUNCHED[4], 4))}


@pytest.fixture(scope="module")
def reference():
    """Weights and logits of the one-process reference run of the example GPT."""
    _, state = reference_run(STEPS, GBS)
    model = GPT(**SIZES)
    model.load_state_dict(state)
    x, _ = eval_batch(StdlibText(**DATA))
    with torch.no_grad():
        return state, model(x)


def _run(jobs, world: int, plan: str) -> tuple[Path, dict]:
    saves, results = jobs[world]
    index = LAUNCHED[world].index(plan)
    return saves / str(index), results[index]


def _sources(where: Path) -> dict[str, Path]:
    step = sorted((where / "fleet").glob("step-*"))[-1]
    return {
        "step dir": step,
        "its state dir": step / "state",
        "FleetCheckpoint dir": where / "fleet",
        "save before restore": where / "before",
        "save after restore": where / "after",
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "plan"), ALL_RUNS)
def test_export_equals_live_weights(jobs, world, plan):
    """Every way to point at the checkpoint gives the live full weights at that step, bit for bit, in the original
    module's key order, fp32."""
    where, result = _run(jobs, world, plan)
    live = result["live"]
    assert [k for k, _, _ in result["recorded"]] == list(live)
    assert result["global_step"] == STEPS or "pp=2" in plan  # (the pipeline path counts its steps elsewhere)
    for name, source in _sources(where).items():
        exported = export_state_dict(source)
        assert list(exported) == list(live), name
        for key, tensor in live.items():
            assert exported[key].dtype == (torch.float32 if tensor.is_floating_point() else tensor.dtype)
            assert torch.equal(exported[key], tensor), f"{plan}, {name}: {key}"


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "plan"), GPT_RUNS)
def test_export_matches_single_process_reference(jobs, reference, world, plan):
    """The exported weights are the one-process reference's after the same steps (only summation order differs)."""
    where, _ = _run(jobs, world, plan)
    exported = export_state_dict(_sources(where)["step dir"])
    for key, tensor in reference[0].items():
        torch.testing.assert_close(exported[key], tensor, atol=2e-5, rtol=0, msg=f"{plan}: {key}")


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "plan"), ALL_RUNS)
def test_restored_module_is_the_plain_original_with_trained_weights(jobs, reference, world, plan):
    """After restore_module: original module types, keys, shapes and dtypes; no DeepSpeed attribute, hook or
    parameter subclass; the user's own hook kept and working; the same weights on every rank; the reference output."""
    _, result = _run(jobs, world, plan)
    assert result["keys"] == result["recorded"]
    assert set(result["module_packages"]) <= {"examples", "tests", "torch"}  # no deepspeed.* module left in the tree
    assert result["ds_attributes"] == [] and result["tensor_attributes"] == []
    assert result["param_types"] == ["Parameter"]
    assert result["hooks"] == 1 and result["user_hook_ran"]
    assert result["ranks_max_diff"] == 0.0 and result["state_ranks_max_diff"] == 0.0
    for key, tensor in result["live"].items():
        assert torch.equal(result["state"][key].float(), tensor), key
    if result["model"] == "TiedGPT":
        assert result["tied"] and int(result["state"]["forwards"]) > 0
    elif "@" not in plan:  # (mixed precision trains other weights than the fp32 reference)
        torch.testing.assert_close(result["logits"], reference[1], atol=1e-4, rtol=0)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "plan"), MIXED_RUNS)
def test_mixed_precision_exports_the_fp32_masters(jobs, world, plan):
    """Under bf16-mixed / 16-mixed the export (live and offline) is DeepSpeed's fp32 master of every parameter, bit for
    bit, read by the worker straight from DeepSpeed's optimizer, wherever it keeps them: ZeRO-0's FP16_UnfusedOptimizer
    wrapper (dp, tp, pp under fp16), ZeRO-1's and the bf16 pipeline's BF16_Optimizer. Not the low-precision weights the
    module trained with, which are the masters rounded."""
    where, result = _run(jobs, world, plan)
    masters, low, live = result["masters"], result["low_precision"], result["live"]
    assert set(masters) == set(live)  # every tensor of the GPT is a trainable parameter
    low_dtype = torch.bfloat16 if plan.startswith("bf16") else torch.float16
    for name, source in _sources(where).items():
        exported = export_state_dict(source)
        for key, master in masters.items():
            assert master.dtype == torch.float32 and torch.equal(exported[key], master), f"{plan}, {name}: {key}"
    for key, master in masters.items():
        assert torch.equal(live[key], master), key
        assert torch.equal(master.to(low_dtype).float(), low[key]), key  # the module's weights are the masters rounded
        assert not torch.equal(master, low[key]), key  # ... and are not what the export returns


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "plan"), ALL_RUNS)
def test_save_after_restore_writes_the_same_checkpoint(jobs, world, plan):
    """The engine keeps a mirror of the tree it trained: saving after the restore writes the same files and tensors
    (optimizer states included), so a resume from it continues exactly."""
    where, _ = _run(jobs, world, plan)
    before, after = where / "before" / "checkpoint", where / "after" / "checkpoint"
    names = sorted(p.name for p in before.iterdir())
    assert names == sorted(p.name for p in after.iterdir())
    for name in names:
        a, b = _tensors(torch.load(before / name, weights_only=False)), _tensors(torch.load(after / name, weights_only=False))
        assert a.keys() == b.keys(), name
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), f"{name}: {key}"


def _tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else []
    return {k: v for key, value in items for k, v in _tensors(value, f"{prefix}/{key}").items()}


EXPORTED_KEYS = (
    "state_dict",
    "hyper_parameters",
    "hparams_name",
    "pytorch-lightning_version",
    "epoch",
    "global_step",
    "lightning_fleet",
)
CHILD = """
import json, sys, torch
from examples.gpt.model import GPT
from tests.workers.tied_gpt import PathGPT, TiedGPT
x = torch.load(sys.argv[1], weights_only=True)
report = {}
for name, path in json.loads(sys.argv[2]).items():
    plain = torch.load(path, weights_only=True)
    model = (TiedGPT if "tied:" in name else PathGPT if "path:" in name else GPT).load_from_checkpoint(path)
    state = model.state_dict()
    same = list(state) == list(plain["state_dict"]) and all(torch.equal(state[k], plain["state_dict"][k]) for k in state)
    with torch.no_grad():
        logits = model.eval()(x)
    torch.save(logits, path + ".logits")
    report[name] = {"same": same, "hparams": dict(model.hparams), "keys": sorted(plain), "plan": plain["lightning_fleet"]["plan"]}
report["imported lightning_fleet"] = any(m == "lightning_fleet" or m.startswith("lightning_fleet.") for m in sys.modules)
print(json.dumps(report))
"""


@pytest.mark.multiprocess
def test_exported_file_loads_without_lightning_fleet(jobs, tmp_path):
    """export_checkpoint -> one file: MyModule.load_from_checkpoint and torch.load(weights_only=True) read it in a
    fresh process that never imports lightning_fleet, and the model computes what the restored module computed."""
    files = {}
    trained = [(world, plan, name) for (world, plan), name in zip(RUNS, RUN_IDS) if runs_here(plan)]
    for world, plan, name in trained:
        where, _ = _run(jobs, world, plan)
        files[name] = str(export_checkpoint(_sources(where)["step dir"], tmp_path / f"{len(files)}.ckpt"))
    x, _ = eval_batch(StdlibText(**DATA))
    torch.save(x, tmp_path / "x.pt")
    done = run([sys.executable, "-c", CHILD, str(tmp_path / "x.pt"), json.dumps(files)], worker_env(tmp_path), timeout=120)
    assert done.returncode == 0, done.stdout[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report.pop("imported lightning_fleet") is False
    for world, plan, name in trained:
        entry, (_, result) = report[name], _run(jobs, world, plan)
        assert entry["same"] and entry["hparams"]["hidden_size"] == SIZES["hidden_size"]
        if plan.startswith("path:"):  # a Path hyper-parameter is written as str: plain torch reads the file
            assert entry["hparams"]["data_dir"] == "/data/corpus"
        assert entry["keys"] == sorted(EXPORTED_KEYS)
        assert entry["plan"] == result["plan"]
        logits = torch.load(files[name] + ".logits", weights_only=True)
        torch.testing.assert_close(logits, result["logits"], atol=1e-6, rtol=0)


# --- broken input: one clear line -------------------------------------------------------------------


def _copy(jobs, tmp_path: Path, source: str, plan: str = "dp=1,tp=2,zero=3") -> Path:
    target = tmp_path / source.replace(" ", "-")
    shutil.copytree(_sources(_run(jobs, 2, plan)[0])[source], target)
    return target


@pytest.mark.multiprocess
def test_tampered_and_partial_checkpoints_are_one_clear_error(jobs, tmp_path):
    """A flipped byte in a FleetCheckpoint step (manifest mismatch), a shard missing or truncated in a plain save, a
    DeepSpeed save without a layout, a layout of an unknown format: each is a FleetError naming what is wrong."""
    step = _copy(jobs, tmp_path, "step dir")
    shard = next((step / "state" / "checkpoint").glob("*optim_states.pt"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(FleetError, match=r"cannot be exported: file state/checkpoint/\S*optim_states.pt does not match its sha"):
        export_state_dict(step)

    missing = _copy(jobs, tmp_path, "save after restore")
    next((missing / "checkpoint").glob("zero_pp_rank_0_mp_rank_01_optim_states.pt")).unlink()
    with pytest.raises(FleetError, match=r"checkpoint is incomplete: .*zero_pp_rank_0_mp_rank_01_optim_states.pt is missing"):
        export_state_dict(missing)

    truncated = _copy(jobs, tmp_path, "save before restore")
    model_states = truncated / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    model_states.write_bytes(model_states.read_bytes()[:100])
    with pytest.raises(FleetError, match=r"cannot read .*model_states.pt .*truncated, corrupted or not a checkpoint file"):
        export_state_dict(truncated)

    bare = _copy(jobs, tmp_path, "its state dir")
    (bare / EXPORT_LAYOUT).unlink()
    with pytest.raises(FleetError, match=r"DeepSpeed checkpoint without fleet_layout.json"):
        export_state_dict(bare)


@pytest.mark.multiprocess
def test_fleet_export_command(jobs, tmp_path, capsys):
    """`fleet export CHECKPOINT --out FILE` writes the file and says so in one line; bad input is one
    `fleet: error: ...` line and exit code 2."""
    source = _sources(_run(jobs, 2, "dp=1,pp=2,zero=1")[0])["FleetCheckpoint dir"]
    assert cli.main(["export", str(source), "--out", str(tmp_path / "out" / "gpt.ckpt")]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and printed[0].startswith(f"{tmp_path / 'out' / 'gpt.ckpt'}: 37 tensors")
    assert torch.load(tmp_path / "out" / "gpt.ckpt", weights_only=True)["state_dict"].keys() == GPT(**SIZES).state_dict().keys()

    odd = _copy(jobs, tmp_path, "save before restore")
    layout = json.loads((odd / EXPORT_LAYOUT).read_text())
    (odd / EXPORT_LAYOUT).write_text(json.dumps({**layout, "format": "lightning_fleet.layout/99"}))
    step = _copy(jobs, tmp_path, "step dir")
    (step / "state" / EXPORT_LAYOUT).write_text((step / "state" / EXPORT_LAYOUT).read_text().replace('"tp": 2', '"tp": 1'))
    (tmp_path / "empty").mkdir()
    bad = {
        str(tmp_path / "nowhere"): "does not exist",
        str(tmp_path / "empty"): "is not a checkpoint",
        str(odd): "has layout format 'lightning_fleet.layout/99'",
        str(step): f"file state/{EXPORT_LAYOUT} does not match its sha256",
        str(odd / "checkpoint"): "holds DeepSpeed's files of one tag; give the checkpoint directory above it",
    }
    for checkpoint, reason in bad.items():
        assert cli.main(["export", checkpoint, "--out", str(tmp_path / "never.ckpt")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("fleet: error: ") and reason in err[0], (checkpoint, err)
    assert not (tmp_path / "never.ckpt").exists()


# --- what a checkpoint's pickles may hold ------------------------------------------------------------


class Colour(enum.Enum):
    """A user's class among the hyper-parameters: outside the allowlist, so its pickle is refused."""

    RED = "red"


@pytest.mark.multiprocess
def test_path_hyperparameter_is_read_and_written_as_str(jobs):
    """A pathlib.Path among the hyper-parameters (what LightningCLI passes for a path argument) unpickles as
    PosixPath(*parts), string parsing only: the resume screen and the export admit it; the exported dict holds it as
    str (plain torch reads the file with weights_only=True; see test_exported_file_loads_without_lightning_fleet)."""
    step = _sources(_run(jobs, 2, "path:dp=2,zero=2")[0])["step dir"]
    states = load_file(step / "state" / "checkpoint" / "mp_rank_00_model_states.pt")  # the restricted unpickler admits it
    assert states["hyper_parameters"]["data_dir"] == Path("/data/corpus")
    payload = lightning_checkpoint(step)
    assert payload["hyper_parameters"]["data_dir"] == "/data/corpus"
    assert set(payload["state_dict"]) == set(GPT(**SIZES).state_dict())


@pytest.mark.multiprocess
def test_a_refused_global_is_named_not_called_corruption(jobs, tmp_path):
    """A class outside the allowlist in a pickle (an Enum hyper-parameter) is one line naming the global, the file and
    what to do; torch's multi-line coloured message never shows. A truncated file is still called damaged."""
    saved = _copy(jobs, tmp_path, "save before restore", "dp=2,zero=2")
    states = saved / "checkpoint" / "mp_rank_00_model_states.pt"
    content = torch.load(states, weights_only=False)  # our own test file
    content["hyper_parameters"]["colour"] = Colour.RED
    torch.save(content, states)
    for read in (export_state_dict, lightning_checkpoint):
        with pytest.raises(FleetError) as caught:
            read(saved)
        message = str(caught.value)
        assert "\n" not in message and "\x1b" not in message and "Weights only load failed" not in message
        assert f"cannot read {states}: it would import " in message and f"{Colour.__module__}.Colour" in message
        assert "save_hyperparameters" in message and "torch.serialization.add_safe_globals" in message
        assert "corrupted" not in message and "pathlib" not in message and "torch._utils" not in message

    torch.serialization.add_safe_globals([Colour])  # the user trusts the class: now it reads
    try:
        assert lightning_checkpoint(saved)["hyper_parameters"]["colour"] is Colour.RED
    finally:
        torch.serialization.clear_safe_globals()


@pytest.mark.pure
def test_fused_wrapper_masters_are_split_by_the_recorded_groups():
    """DeepSpeed's FP16_Optimizer (a fused optimizer, CUDA only) saves one flat fp32 tensor per group, its parameters
    back to back as torch._utils._flatten_dense_tensors lays them: the layout's [name, shape] lists split it; a group
    whose size disagrees is one line."""
    a, b, c = torch.randn(2, 3), torch.randn(4), torch.randn(5)
    groups = [[["a", [2, 3]], ["b", [4]]], [["c", [5]]]]
    saved = {"fp32_groups_flat": [_flatten_dense_tensors([a, b]), _flatten_dense_tensors([c])], "cur_scale": 1.0}
    merged = _wrapper_merge(saved, groups)
    assert list(merged) == ["a", "b", "c"] and all(torch.equal(merged[k], v) for k, v in zip("abc", (a, b, c)))
    with pytest.raises(FleetError, match=r"fp32 master group holds 10 elements, its parameters 9"):
        _wrapper_merge(saved, [[["a", [2, 3]], ["b", [3]]], [["c", [5]]]])
    unfused = {"fp32_groups": [[a, b], [c]]}
    assert torch.equal(_wrapper_merge(unfused, groups)["c"], c)
    with pytest.raises(FleetError, match=r"holds no fp32 master weights"):
        _wrapper_merge({"cur_scale": 1.0}, groups)


@pytest.mark.multiprocess
@pytest.mark.parametrize("plan", ["dp=2,zero=1", "dp=2,zero=3"])
def test_a_reshard_unpickles_every_file_through_the_restricted_loader(jobs, tmp_path, monkeypatch, plan):
    """Tripwire (issue 22 item 10): the universal conversion of a real dp=2 checkpoint -- DeepSpeed's ds_to_universal,
    run here in this process as its converter subprocess runs it, and the normalisation after it -- unpickles nothing
    with Python's own unpickler (the one torch.load uses without our pickle module): every file goes through
    safe_load's RestrictedUnpickler. Before the fix the converter's torch.load reached itself (RecursionError)."""
    import pickle

    from lightning_fleet.elastic.layout import deepspeed_files
    from lightning_fleet.runtime.deepspeed import convert
    from lightning_fleet.runtime.deepspeed.universal import normalize_universal

    unsafe: list[str] = []

    class Tripwire(pickle.Unpickler):
        def __init__(self, file, *args, **kwargs):  # type: ignore[no-untyped-def]
            unsafe.append(repr(getattr(file, "name", file)))
            raise AssertionError("an unrestricted unpickler was used")

    monkeypatch.setattr(pickle, "Unpickler", Tripwire)
    monkeypatch.setattr(pickle, "load", lambda *a, **k: Tripwire(a[0] if a else None))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: Tripwire(None))
    monkeypatch.setattr(torch, "load", torch.load)  # convert.main replaces it: given back after the test
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    restricted: list[str] = []
    checked = convert.load_file
    monkeypatch.setattr(convert, "load_file", lambda path, **kw: (restricted.append(str(path)), checked(path, **kw))[1])
    step = sorted((_run(jobs, 2, plan)[0] / "fleet").glob("step-*"))[-1]
    out = tmp_path / "universal"
    assert convert.main(["--input_folder", str(deepspeed_files(step)), "--output_folder", str(out),
                         "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"]) == 0
    normalize_universal(out)
    assert not unsafe, unsafe
    assert len(restricted) > 2 and any("optim_states" in p for p in restricted)  # ran here, through the loader
    assert sorted(p.name for p in (out / "zero").iterdir())  # the conversion wrote the parameters' fragments
