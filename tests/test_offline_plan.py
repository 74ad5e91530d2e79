"""``fleet plan --module`` / ``fleet estimate --module``: the user's own module, built once on the meta device, profiled
on an example batch and planned offline (lightning_fleet/offline.py and the --module options of lightning_fleet/cli.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_fleet.cli import main
from lightning_fleet.offline import TensorShape, materialize, parse_batch, read_config
from lightning_fleet.planning import FleetError

ROOT = Path(__file__).resolve().parents[1]
GPT = "examples.gpt.model:GPT"
GPT_ARGS = "{num_layers: 2, hidden_size: 64, num_heads: 4, seq_length: 32, vocab_size: 256}"
GPT_BATCH = "(long[4,32], long[4,32])"


@pytest.fixture(autouse=True)
def _in_the_repository(monkeypatch):
    """``examples.gpt.model`` is importable from the current directory, as a user runs ``fleet`` from their project."""
    monkeypatch.chdir(ROOT)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def gpt_params(**kwargs) -> int:
    """The example GPT's parameter count at these arguments (built on meta: no weights)."""
    from examples.gpt.model import GPT as GPTClass

    with torch.device("meta"):
        return sum(p.numel() for p in GPTClass(**kwargs).parameters())


def write_module(tmp_path: Path, source: str, name: str = "user_model.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


# --- the batch grammar --------------------------------------------------------------------------------------------


@pytest.mark.pure
def test_batch_grammar_reads_tensors_tuples_lists_and_mappings():
    """Tensors with torch's dtype names, tuples, lists and mappings, nested, spaces and trailing commas allowed."""
    assert parse_batch("long[8,512]") == TensorShape("long", (8, 512))
    assert parse_batch(" ( long[8, 512], float[8] ) ") == (TensorShape("long", (8, 512)), TensorShape("float", (8,)))
    assert parse_batch("[bfloat16[2,3,4],]") == [TensorShape("bfloat16", (2, 3, 4))]
    nested = parse_batch("{input_ids: long[8,512], extra: (bool[8], {mask: uint8[8,512]})}")
    extra = (TensorShape("bool", (8,)), {"mask": TensorShape("uint8", (8, 512))})
    assert nested == {"input_ids": TensorShape("long", (8, 512)), "extra": extra}


@pytest.mark.pure
def test_a_batch_is_made_on_meta_or_as_zeros_and_seeded_noise_without_touching_the_rng():
    """On meta: shapes and dtypes only. On the CPU: integer tensors zeros (valid ids), floats standard normal from a
    generator of its own, the same every time; the process's RNG stream is left where it was."""
    tree = parse_batch("{ids: long[2,3], x: float[2,4]}")
    meta = materialize(tree, torch.device("meta"))
    assert meta["ids"].is_meta and meta["ids"].shape == (2, 3) and meta["x"].dtype is torch.float32
    before = torch.get_rng_state()
    real = materialize(tree, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before)
    assert real["ids"].dtype is torch.long and not real["ids"].any()
    assert real["x"].std() > 0 and torch.equal(real["x"], materialize(tree, torch.device("cpu"))["x"])


@pytest.mark.pure
@pytest.mark.parametrize(
    "text,expected",
    [
        ("long[8,x]", "expected a dimension (a positive integer), found 'x' at position 8"),
        ("long[8,0]", "expected a positive dimension, found '0' at position 8"),
        ("tensor[8]", "expected a torch dtype name"),
        ("(long[8], long[8]", "expected ',', found the end"),
        ("{long[8]}", "expected ':', found '['"),
        ("long[8]]", "expected the end of the batch, found ']'"),
        ("()", "expected at least one tensor inside the brackets"),
        ("long[8] & x", "found '&' at position 9"),
    ],
)
def test_a_bad_batch_spec_is_one_line_with_the_position(text, expected):
    with pytest.raises(FleetError) as err:
        parse_batch(text)
    message = str(err.value)
    assert expected in message and "\n" not in message and "(long[8,512], long[8,512])" in message


@pytest.mark.pure
def test_a_lightningcli_config_with_class_paths_and_one_with_fixed_classes(tmp_path):
    """Both LightningCLI spellings: ``model: {class_path, init_args}`` and the arguments alone (the CLI fixes the
    class, as examples/gpt/config.yaml); trainer.precision and FleetStrategy's global_batch_size are read."""
    fixed = read_config(str(ROOT / "examples/gpt/config.yaml"))
    assert fixed.model_class is None and fixed.model_args["num_layers"] == 4 and fixed.data_class is None
    assert fixed.data_args == {"seq_length": 128, "batch_size": 16, "limit_bytes": 2000000}
    assert fixed.precision == "32-true" and fixed.global_batch_size == 32
    path = tmp_path / "cli.yaml"
    path.write_text(
        "fit:\n  model:\n    class_path: examples.gpt.model.GPT\n    init_args: {num_layers: 2}\n"
        "  trainer: {precision: bf16, strategy: fleet}\n"
    )
    nested = read_config(str(path))
    assert nested.model_class == "examples.gpt.model.GPT" and nested.model_args == {"num_layers": 2}
    assert nested.precision == "bf16" and nested.global_batch_size is None and nested.data_args is None


# --- planning a module -------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_the_example_gpt_via_module_gives_a_plan(capsys):
    """fleet plan --module examples.gpt.model:GPT: built on meta, profiled exactly (meta), planned on a preset cluster;
    the profiler's report is printed above the plan table, the default global batch is the example batch x world."""
    argv = ("plan", "--module", GPT, "--init-args", GPT_ARGS, "--batch", GPT_BATCH, "--cluster", "dgx-h100")
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    obj = json.loads(out)
    assert obj["module"]["built_on"] == "meta" and obj["module"]["profiling"] == "meta"
    assert obj["plans"] and all(e["plan"]["dp"] * e["plan"]["mbs"] * e["plan"]["gas"] == 32 for e in obj["plans"])  # 4 x 8
    assert obj["plans"][0]["model"]["params"] == gpt_params(num_layers=2, hidden_size=64, num_heads=4, seq_length=32)
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    report, table = out.split("GPT (", 1)
    assert "module   examples.gpt.model:GPT: GPT(num_layers=2" in report and "built on the meta device" in report
    assert "batch    (int64[4,32], int64[4,32]) (--batch); precision 32-true; global batch 32" in report
    assert "profiling: meta (exact, training_step on meta tensors)" in report
    assert "on dgx-h100 (8 devices)" in table and "step s" in table


@pytest.mark.unit
def test_the_example_gpt_via_its_lightningcli_config(capsys, tmp_path):
    """The example's own config (LightningCLI with fixed classes): the classes named on the command line, the batch
    read from the datamodule as the strategy reads it, precision and global batch from the config. A class-path
    config names the classes itself; --init-args and --batch override it."""
    code, out, err = run_cli(
        capsys, "plan", "--config", "examples/gpt/config.yaml", "--module", GPT, "--datamodule", "examples.gpt.data:StdlibText",
        "--cluster", "dgx-h100", "--json",
    )
    assert code == 0, err
    obj = json.loads(out)
    batch_line = next(line for line in obj["module"]["report"] if line.startswith("batch"))
    assert "[int64[16,128], int64[16,128]] (the first training batch of StdlibText)" in batch_line  # collated: a list
    assert "global batch 32 (the config's FleetStrategy global_batch_size)" in batch_line
    assert obj["plans"][0]["model"]["params"] == gpt_params(num_layers=4, hidden_size=128, num_heads=4, seq_length=128)
    config = tmp_path / "gpt.yaml"
    config.write_text(
        "model:\n  class_path: examples.gpt.model.GPT\n"
        "  init_args: {num_layers: 3, hidden_size: 64, num_heads: 4, seq_length: 32}\n"
        "trainer:\n  precision: bf16-mixed\n"
    )
    code, out, err = run_cli(capsys, "plan", "--config", str(config), "--init-args", "{num_layers: 2}", "--batch", GPT_BATCH,
                             "--cluster", "dgx-h100", "--json")
    assert code == 0, err
    obj = json.loads(out)
    assert obj["plans"][0]["model"]["params"] == gpt_params(num_layers=2, hidden_size=64, num_heads=4, seq_length=32)
    assert any("precision bf16-mixed" in line for line in obj["module"]["report"])


@pytest.mark.unit
def test_estimate_prices_one_plan_of_the_module(capsys):
    code, out, err = run_cli(capsys, "estimate", "--module", GPT, "--init-args", GPT_ARGS, "--batch", GPT_BATCH,
                             "--cluster", "dgx-h100",
                             "--plan", "dp=8,zero=1,mbs=2", "--json")
    assert code == 0, err
    obj = json.loads(out)
    assert obj["fits"] is True and obj["plan"]["gas"] == 2 and obj["module"]["class_path"] == GPT


PLAIN = """
    import torch
    from torch import nn

    class MLP(nn.Module):
        def __init__(self, width: int = 64, depth: int = 3):
            super().__init__()
            print("building MLP")  # the user's output goes to stderr: stdout holds the one JSON object
            self.layers = nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))

        def forward(self, x):
            print("forward", tuple(x.shape))
            return self.layers(x)
"""


@pytest.mark.unit
def test_a_plain_nn_module_is_profiled_forward_only(capsys, tmp_path):
    """A plain nn.Module from a file path: profiled as module(batch) (forward only, said in one line) and planned; what
    it prints goes to stderr, so stdout stays one JSON object."""
    path = write_module(tmp_path, PLAIN)
    code, out, err = run_cli(capsys, "plan", "--module", f"{path}:MLP", "--init-args", '{"width": 32}', "--batch", "float[16,32]",
                             "--cluster", "cpu", "--json")
    assert code == 0, err
    obj = json.loads(out)
    assert "building MLP" in err and "forward (16, 32)" in err
    assert any("plain nn.Module: profiled as module(batch), the forward only" in line for line in obj["module"]["report"])
    assert obj["plans"][0]["model"]["params"] == 3 * (32 * 32 + 32)
    assert obj["plans"][0]["model"]["flops_per_sample"] == pytest.approx(3 * 2 * 32 * 32)


NO_STEP = """
    from lightning.pytorch import LightningModule
    from torch import nn

    class NoStep(LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
"""

BAD_MODULE = [
    (["--module", "nosuch_pkg.model:Net"], "cannot import nosuch_pkg.model (no module named 'nosuch_pkg'); run from the"),
    (["--module", "examples.gpt.model:Nope"], "examples.gpt.model has no attribute 'Nope'"),
    (["--module", "examples.gpt.data:StdlibText"], "is not a subclass of torch.nn.Module (it is StdlibText)"),
    (["--module", "GPT"], "expected pkg.module:Class, pkg.module.Class or path/to/file.py:Class"),
    (["--module", "missing/file.py:Net"], "no such file 'missing/file.py'"),
    (["--module", GPT, "--init-args", "{nope: 1}"], "GPT arguments (--init-args)"),
    (["--module", GPT, "--init-args", "{num_layers: many}"], "num_layers"),
    (["--module", GPT, "--init-args", "{num_layers: [1"], "--init-args '{num_layers: [1' is not JSON or YAML"),
    (["--module", GPT, "--init-args", "[1, 2]"], "must be a mapping of argument names to values"),
    (["--module", GPT, "--batch", "long[8,x]"], "--batch 'long[8,x]': expected a dimension"),
    (["--module", GPT], "planning a module needs an example batch: --batch"),
    (["--config", "examples/gpt/config.yaml", "--module", GPT], "the config's data: section has no class_path: name its class"),
    (["--config", "examples/gpt/config.yaml"], "has no model.class_path: name the module's class with --module pkg.mod:Class"),
    (["--config", "missing.yaml"], "cannot read LightningCLI config file 'missing.yaml'"),
    (["--module", GPT, "--precision", "64-true"], "--precision '64-true': strategy 'fleet' trains 32-true, 32, bf16-mixed"),
    (["--module", GPT, "--model", "gpt-tiny"], "--model plans a model file, --module your own module: use one or the other"),
    (["--batch", "long[8]"], "say what to plan: --model (a model YAML or preset) or --module pkg.mod:Class"),
    (["--module", "NOSTEP:NoStep", "--batch", "float[2,4]"], "NoStep is a LightningModule without training_step: implement it"),
    (["--module", GPT, "--datamodule", "examples.gpt.model:GPT"], "is not a subclass of lightning.pytorch.LightningDataModule"),
    (["--module", GPT, "--batch", GPT_BATCH, "--runtime", "deepspeed", "--fix", "pp=2,tp=2"], "pipeline engine runs"),
]


@pytest.mark.unit
@pytest.mark.parametrize("argv,message", BAD_MODULE, ids=[m[:40] for _, m in BAD_MODULE])
def test_every_error_is_one_line_with_exit_2(capsys, tmp_path, argv, message):
    """Import errors, missing classes, bad arguments, bad batch specs, a LightningModule without training_step, ...:
    exit 2, nothing on stdout, one line on stderr naming the problem."""
    no_step = write_module(tmp_path, NO_STEP, "no_step.py")
    argv = [a.replace("NOSTEP", str(no_step)) for a in argv]
    code, out, err = run_cli(capsys, "plan", *argv, "--cluster", "dgx-h100")
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("fleet: error: "), err
    assert message in err


NO_TP = """
    from examples.gpt.model import GPT

    class GPTWithoutTensorParallel(GPT):
        fleet_tensor_parallel = None  # no hook: DeepSpeed cannot split it
"""


@pytest.mark.unit
def test_runtime_deepspeed_reads_the_modules_real_hooks(capsys, tmp_path):
    """--runtime deepspeed plans what strategy='fleet' runs for this module: without fleet_tensor_parallel() no plan
    shown or rejected has tp > 1, and fixing tp=2 is refused naming the missing hook; the example GPT (which has
    the hook) is allowed tp=2."""
    path = write_module(tmp_path, NO_TP, "no_tp.py")
    common = ["--init-args", GPT_ARGS, "--batch", GPT_BATCH, "--cluster", "dgx-h100", "--runtime", "deepspeed"]
    code, out, err = run_cli(capsys, "plan", "--module", f"{path}:GPTWithoutTensorParallel", *common, "--top", "20", "--json")
    assert code == 0, err
    obj = json.loads(out)
    assert all(e["plan"]["tp"] == 1 for e in obj["plans"])
    assert all(",tp=1," in r["plan"] for r in obj["rejected"])
    code, _, err = run_cli(capsys, "plan", "--module", f"{path}:GPTWithoutTensorParallel", *common, "--fix", "tp=2")
    assert code == 2 and "GPTWithoutTensorParallel defines no fleet_tensor_parallel() hook: add it or use tp=1" in err
    code, out, err = run_cli(capsys, "plan", "--module", GPT, *common, "--fix", "tp=2", "--json")
    assert code == 0, err
    assert all(e["plan"]["tp"] == 2 for e in json.loads(out)["plans"])


WATCHED = """
    import torch
    from lightning.pytorch import LightningModule
    from torch import nn

    BUILT = []  # every instance, at the end of its construction, with what it looked like then

    class Watched(LightningModule):
        def __init__(self, width: int = 8, needs_real_tensors: bool = False):
            super().__init__()
            self.save_hyperparameters()
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
            self.seen = []
            if needs_real_tensors:  # .item() cannot run on the meta device: built on the CPU instead
                self.scale = float(torch.ones(1).item())
            BUILT.append((self, {k: v.clone() if v.device.type != "meta" else v for k, v in self.state_dict().items()},
                          sorted(self.__dict__), [id(p) for p in self.parameters()]))

        def training_step(self, batch, batch_idx):
            self.seen.append(batch_idx)
            x = batch
            for layer in self.layers:
                x = layer(x)
            loss = x.pow(2).mean()
            self.log("loss", loss)
            return loss
"""


@pytest.mark.unit
@pytest.mark.parametrize("needs_real_tensors", [False, True], ids=["meta", "cpu-fallback"])
def test_the_module_is_built_once_and_left_unchanged(capsys, tmp_path, needs_real_tensors):
    """The class is constructed once (on meta; on the CPU, after a failed meta attempt, with a one-line note) and
    nothing of the built module changes: same attributes, same parameter objects, same weights, nothing appended."""
    path = write_module(tmp_path, WATCHED, f"watched_{needs_real_tensors}.py")
    argv = ["plan", "--module", f"{path}:Watched", "--init-args", json.dumps({"needs_real_tensors": needs_real_tensors}),
            "--batch", "float[4,8]", "--cluster", "cpu", "--json"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    built = next(m for name, m in sys.modules.items() if getattr(m, "__file__", None) == str(path.resolve())).BUILT
    assert len(built) == 1
    module, weights, attributes, params = built[0]
    assert sorted(module.__dict__) == attributes and [id(p) for p in module.parameters()] == params
    assert module.seen == [] and module.training
    report = json.loads(out)["module"]["report"]
    if needs_real_tensors:
        assert "built on the CPU (weights allocated): building it on the meta device failed: RuntimeError" in report[0]
        assert all(torch.equal(module.state_dict()[k], v) for k, v in weights.items())
    else:
        assert "built on the meta device (no weights allocated)" in report[0]
        assert all(p.is_meta for p in module.parameters())


@pytest.mark.unit
def test_precisions_are_the_strategys():
    """The offline precision is the strategy's (one table for every Lightning spelling), legacy spellings included."""
    from lightning_fleet.offline import lightning_precision
    from lightning_fleet.planning import Precision
    from lightning_fleet.planning.model import LIGHTNING_PRECISIONS

    for name, kind in LIGHTNING_PRECISIONS.items():
        assert lightning_precision(name) is Precision.from_lightning(name) is kind
    assert lightning_precision("bf16") is Precision.BF16_MIXED and lightning_precision("16") is Precision.FP16_MIXED


@pytest.mark.unit
def test_planning_a_model_file_still_loads_no_torch():
    """fleet plan --model stays torch-free: the offline module (and torch) load only for --module."""
    code = (
        "import sys; from lightning_fleet.cli import main; "
        "rc = main(['plan', '--model', 'gpt-tiny', '--cluster', 'cpu', '--json']); "
        "bad = sorted(m for m in ('torch', 'lightning', 'lightning_fleet.offline') if m in sys.modules); "
        "print(bad, file=sys.stderr); sys.exit(rc or (1 if bad else 0))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr


NESTED = """
    from lightning.pytorch import LightningModule
    from torch import nn

    class Wrapper(LightningModule):
        def __init__(self, encoder: nn.Module, depth: int = 2):
            super().__init__()
            self.encoder = encoder
            self.layers = nn.ModuleList(nn.Linear(encoder.out_features, encoder.out_features) for _ in range(depth))

        def training_step(self, batch, batch_idx):
            x = self.encoder(batch)
            for layer in self.layers:
                x = layer(x)
            return x.mean()
"""


@pytest.mark.unit
def test_nested_class_path_arguments_are_built_as_lightningcli_builds_them(capsys, tmp_path):
    """An argument typed as a class, given as {class_path, init_args} in the config, is built (on meta) as LightningCLI
    builds it; a string where an int is expected is refused before anything is built."""
    path = write_module(tmp_path, NESTED, "nested.py")
    config = tmp_path / "nested.yaml"
    config.write_text(
        f"model:\n  class_path: {path}:Wrapper\n  init_args:\n    depth: 3\n"
        "    encoder: {class_path: torch.nn.Linear, init_args: {in_features: 16, out_features: 8}}\n"
    )
    code, out, err = run_cli(capsys, "plan", "--config", str(config), "--batch", "float[4,16]", "--cluster", "cpu", "--json")
    assert code == 0, err
    obj = json.loads(out)
    assert obj["module"]["built_on"] == "meta"
    assert obj["plans"][0]["model"]["params"] == 16 * 8 + 8 + 3 * (8 * 8 + 8)
    code, out, err = run_cli(capsys, "plan", "--config", str(config), "--init-args", "{depth: three}", "--batch", "float[4,16]",
                             "--cluster", "cpu")
    assert code == 2 and out == "" and err.count("\n") == 1 and 'Parser key "model.depth"' in err
