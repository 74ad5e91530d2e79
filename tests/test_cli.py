"""The fleet command: JSON shapes, readable tables, plots, and exit code 2 with one line for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_fleet.cli import main

ROOT = Path(__file__).resolve().parents[1]

ESTIMATE_KEYS = {
    "model": {"params", "flops_per_sample"},
    "plan": {"dp", "tp", "pp", "zero", "mbs", "gas", "recompute", "sp", "vpp", "offload"},
    "memory": {"params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "other_bytes", "total_bytes", "limit_bytes", "host_bytes"},
    "time": {"step_s", "compute_s", "tp_comm_s", "pp_comm_s", "dp_comm_s", "bubble_s", "offload_s"},
    "throughput": {"samples_per_s", "tokens_per_s", "model_tflops_per_device", "hardware_tflops_per_device"},
}


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def check_estimate_shape(obj: dict) -> None:
    for key, fields in ESTIMATE_KEYS.items():
        assert fields <= set(obj[key]), (key, set(obj[key]))
    assert isinstance(obj["fits"], bool)
    assert isinstance(obj["model"]["params"], int)
    memory = obj["memory"]
    assert memory["total_bytes"] == pytest.approx(sum(memory[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "other_bytes")))
    time = obj["time"]
    assert time["step_s"] == pytest.approx(sum(v for k, v in time.items() if k != "step_s"))


@pytest.mark.pure
def test_estimate_json_is_one_object_with_the_documented_fields(capsys):
    """fleet estimate --json prints exactly one JSON object with every documented key."""
    code, out, err = run_cli(capsys, "estimate", "--model", "gpt3-175b", "--cluster", "dgx-a100-80gb-x128", "--plan", "dp=8,tp=8,pp=16,mbs=1,recompute=full", "--json")
    assert code == 0 and err == ""
    obj = json.loads(out)
    check_estimate_shape(obj)
    assert obj["plan"] == {**obj["plan"], "dp": 8, "tp": 8, "pp": 16, "gas": 192, "recompute": "full", "zero": 0, "sp": False, "vpp": 1, "offload": "none"}
    assert obj["fits"] is True


@pytest.mark.pure
def test_plan_json_lists_plans_rejections_and_search(capsys):
    """fleet plan --json: plans best first, rejected with reasons, search counts and seconds."""
    code, out, _ = run_cli(capsys, "plan", "--model", "gpt-1.7b", "--cluster", "dgx-a100-80gb", "--top", "3", "--json")
    assert code == 0
    obj = json.loads(out)
    assert len(obj["plans"]) == 3
    for e in obj["plans"]:
        check_estimate_shape(e)
        assert e["fits"]
    steps = [e["time"]["step_s"] for e in obj["plans"]]
    assert steps == sorted(steps)
    assert all(set(r) == {"plan", "kind", "reason"} and r["reason"] for r in obj["rejected"])
    assert {r["kind"] for r in obj["rejected"]} <= {"layout", "memory", "slower"}
    assert set(obj["search"]) >= {"candidates", "feasible", "seconds"}
    assert obj["search"]["candidates"] >= obj["search"]["feasible"] >= 3


@pytest.mark.pure
def test_plan_table(capsys):
    """Without --json a readable table."""
    code, out, _ = run_cli(capsys, "plan", "--model", "gpt-1.7b", "--cluster", "dgx-a100-80gb", "--top", "2")
    assert code == 0
    assert "candidates" in out and "step s" in out and "dp=" in out


@pytest.mark.pure
def test_plan_plot(capsys, tmp_path):
    """--plot writes a PNG (matplotlib is the optional ``plot`` extra)."""
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra (matplotlib)")
    png = tmp_path / "plan.png"
    code, out, _ = run_cli(capsys, "plan", "--model", "gpt-1.7b", "--cluster", "dgx-a100-80gb", "--top", "2", "--plot", str(png))
    assert code == 0 and f"plot written to {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.pure
def test_estimate_table(capsys):
    """Without --json the estimate prints memory and time terms and a verdict."""
    code, out, _ = run_cli(capsys, "estimate", "--model", "gpt-tiny", "--cluster", "cpu", "--plan", "dp=2")
    assert code == 0
    assert "optimizer states" in out and "pipeline bubble" in out and "fits" in out


BAD = [
    (["plan", "--model", "nope", "--cluster", "cpu"], "no model file or preset named 'nope'"),
    (["plan", "--model", "gpt-tiny", "--cluster", "cpu", "--top", "0"], "--top must be >= 1"),
    (["plan", "--model", "gpt-tiny", "--cluster", "cpu", "--zero-stages", "1,x"], "--zero-stages must be comma-separated integers"),
    (["plan", "--model", "gpt-tiny", "--cluster", "cpu", "--zero-stages", "5"], "5 is not a ZeRO stage"),
    (["plan", "--model", "gpt-tiny", "--cluster", "cpu", "--global-batch-size", "0"], "--global-batch-size must be >= 1"),
    (["estimate", "--model", "gpt-tiny", "--cluster", "cpu", "--plan", "dp=4,tp=2"], "dp(4) * tp(2) * pp(1) = 8 != world size 2"),
    (["estimate", "--model", "gpt-tiny", "--cluster", "cpu", "--plan", "dp=1,tp=2,mbs=3"], "global batch size 16 is not divisible by dp(1) * mbs(3) = 3"),
    (["estimate", "--model", "gpt-tiny", "--cluster", "cpu", "--plan", "dp=1,tp=2,pp=1,gas=3"], "dp(1) * mbs(1) * gas(3) = 3 != global batch size 16"),
    (["estimate", "--model", "gpt-tiny", "--cluster", "cpu", "--plan", "dp=2,flavour=3"], "unknown key 'flavour'"),
    (["estimate", "--model", "gpt-tiny", "--cluster", "cpu", "--plan", "dp=2,zero=7"], "zero must be 0, 1, 2 or 3, got 7"),
    (["estimate", "--model", "gpt-3-x", "--cluster", "cpu", "--plan", "dp=2"], "no model file or preset"),
    (["plan", "--model", "gpt3-175b", "--cluster", "cpu"], "needs"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["plan", "--model", "gpt-tiny", "--cluster", "cpu", "--max-tp", "0"], "--max-tp must be >= 1, got 0"),
    (["plan", "--model", "gpt-tiny", "--cluster", "cpu", "--fix", "mbs=x"], "mbs must be an integer, got 'x'"),
    (["plan", "--model", "gpt-tiny", "--cluster", "cpu", "--fix", "zero=3", "--zero-stages", "0,1"],
     "zero=3 is not allowed here (allowed: zero 0, 1)"),
    (["plan", "--model", "gpt-tiny", "--cluster", "cpu", "--fix", "mbs=3"],
     "mbs 3 does not split the global batch size (16) / dp into mbs * gas"),
    (["plan", "--model", "gpt-tiny", "--cluster", "cpu", "--fix", "tp=2,sp=true", "--no-sp"],
     "sp=true is not allowed here (allowed: sp=false)"),
    (["plan", "--model", "gpt-tiny"], "the following arguments are required: --cluster"),
]


@pytest.mark.pure
@pytest.mark.parametrize("argv,message", BAD)
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
    """Every bad input: exit code 2, nothing on stdout, exactly one line on stderr naming the problem."""
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("fleet: error: ")
    assert message in err


@pytest.mark.pure
def test_estimate_names_every_factor_of_an_impossible_plan(capsys):
    """A plan that is wrong in several ways names each factor."""
    code, _, err = run_cli(capsys, "estimate", "--model", "gpt-tiny", "--cluster", "dgx-a100-80gb", "--plan", "dp=1,tp=3,pp=3,vpp=2,gas=4")
    assert code == 2
    for part in ("dp(1) * tp(3) * pp(3) = 9 != world size 8", "tp(3) does not divide num_heads(4)", "pp(3) * vpp(2) = 6 does not divide num_layers(4)", "dp(1) * mbs(1) * gas(4) = 4 != global batch size 16"):
        assert part in err


@pytest.mark.unit
@pytest.mark.parametrize("command", [["fleet"], [sys.executable, "-m", "lightning_fleet"]])
def test_console_script_and_module_both_work(command, tmp_path):
    """The installed `fleet` script and `python -m lightning_fleet` run the same CLI, and bad input exits 2."""
    if command == ["fleet"]:
        script = Path(sys.executable).with_name("fleet")
        assert script.exists(), "the console script is installed with the package"
        command = [str(script)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run([*command, "plan", "--model", "gpt-tiny", "--cluster", "cpu", "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["plans"]
    bad = subprocess.run([*command, "plan", "--model", "gpt-tiny", "--cluster", str(tmp_path / "missing.yaml")], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("fleet: error: ") and bad.stderr.count("\n") == 1


@pytest.mark.unit
def test_planning_core_imports_no_torch_lightning_or_deepspeed():
    """lightning_fleet.planning (and the CLI) stand alone: importing them loads no heavy framework."""
    code = (
        "import sys, lightning_fleet.planning, lightning_fleet.cli; "
        "bad = sorted(m for m in ('torch', 'lightning', 'deepspeed', 'pytorch_lightning') if m in sys.modules); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.pure
def test_plan_fix_keeps_the_fixed_axes_and_chooses_the_rest(capsys):
    """fleet plan --fix zero=1,mbs=4: every plan has ZeRO-1 and micro-batches of 4; layouts and the rest still vary."""
    argv = ("plan", "--model", "gpt-1.7b", "--cluster", "dgx-a100-80gb", "--top", "5", "--fix", "zero=1,mbs=4", "--json")
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    plans = [e["plan"] for e in json.loads(out)["plans"]]
    assert len(plans) == 5 and all(p["zero"] == 1 and p["mbs"] == 4 for p in plans)
    assert len({(p["dp"], p["tp"], p["pp"]) for p in plans}) > 1


@pytest.mark.pure
def test_estimate_table_says_why_a_plan_does_not_fit(capsys):
    """A plan that does not fit: the verdict names the need, the device size and the largest term."""
    code, out, _ = run_cli(capsys, "estimate", "--model", "gpt3-175b", "--cluster", "dgx-a100-80gb", "--plan", "dp=8")
    assert code == 0
    assert "does not fit: needs " in out and "> 80.00 GiB" in out and "largest term optimizer states" in out


PIPED = [
    ["estimate", "--model", "gpt-tiny", "--cluster", "cpu", "--plan", "dp=2", "--json"],
    ["estimate", "--model", "gpt-tiny", "--cluster", "cpu", "--plan", "dp=2"],
    ["plan", "--model", "gpt-tiny", "--cluster", "cpu", "--json"],
    ["plan", "--model", "gpt-tiny", "--cluster", "cpu"],
]


@pytest.mark.unit
@pytest.mark.parametrize("argv", PIPED, ids=["estimate-json", "estimate-table", "plan-json", "plan-table"])
def test_a_reader_that_went_away_ends_quietly(argv):
    """Output into a pipe whose reader has exited (`fleet ... | head`): no traceback, nothing on stderr, and the status a
    shell shows for coreutils killed by SIGPIPE (141). The reader is closed before fleet writes, so the pipe breaks
    on every run."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "lightning_fleet", *argv], stdout=write, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    finally:
        os.close(write)
    assert done.stderr == "" and done.returncode == 141


@pytest.mark.unit
def test_head_reads_the_start_of_the_json(tmp_path):
    """`fleet plan --json | head -c 10` through a shell: head gets the first bytes; fleet prints no traceback whether
    or not the pipe broke before it finished writing (61 kB of JSON against head reading 10 bytes)."""
    err = tmp_path / "err.txt"
    fleet = f"{sys.executable} -m lightning_fleet plan --model gpt3-175b --cluster dgx-a100-80gb-x128 --top 50 --json"
    command = f"{fleet} 2>{err} | head -c 10"
    done = subprocess.run(["bash", "-c", command + "; exit ${PIPESTATUS[0]}"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert done.stdout == '{"plans": '
    assert err.read_text() == "" and done.returncode in (0, 141)


ANCHORED_CLUSTER = """\
name: anchored
groups:
  - nodes: 1
    devices_per_node: 2
    device: &a100
      name: A100-SXM4-80GB
      memory_gib: 80
      peak_tflops: {bf16: 312, fp16: 312, fp32: 19.5}
  - nodes: 1
    devices_per_node: 2
    device:
      <<: *a100
      name: A100-SXM4-40GB
      memory_gib: 40
intra_node: &link {bandwidth_GBps: 150, latency_us: 5}
inter_node: *link
"""


@pytest.mark.pure
def test_anchors_aliases_and_merge_keys_still_plan(capsys, tmp_path):
    """The strict loader refuses a key given twice, not YAML's own reuse: an anchored device, an aliased link and a merge
    key whose mapping overrides two of the merged keys plan as before."""
    path = tmp_path / "anchored.yaml"
    path.write_text(ANCHORED_CLUSTER)
    code, out, err = run_cli(capsys, "plan", "--model", "gpt-tiny", "--cluster", str(path), "--top", "1", "--json")
    assert code == 0, err
    best = json.loads(out)["plans"][0]["plan"]
    assert best["dp"] * best["tp"] * best["pp"] == 4  # both groups, the second's device from the merge


@pytest.mark.pure
def test_error_line_is_one_printable_bounded_line():
    """The last guard of every error: line breaks and control characters cannot split or colour the line, and a long
    message keeps its start and its end (what to do)."""
    from lightning_fleet.cli import ERROR_CHARS, error_line

    line = error_line("first\nsecond\r\u2028third \x1b[31m" + "x" * 10**6 + " do this")
    assert len(line.splitlines()) == 1 and len(line) <= ERROR_CHARS and line.isprintable()
    assert line.startswith("fleet: error: first second") and "\\x1b[31m" in line and line.endswith(" do this")
    assert error_line("short") == "fleet: error: short"


@pytest.mark.pure
def test_the_largest_accepted_sizes_plan_in_bounded_time(capsys, tmp_path):
    """The bounds that keep the planner's loops finite are not a hang at the edge: 2**20 devices, 16,384 layers and a
    global batch of 2**32 plan in seconds (2.5 s measured here); one more of each is refused, the line naming the bound."""
    from lightning_fleet.planning.cluster import MAX_WORLD_SIZE
    from lightning_fleet.planning.model import MAX_GLOBAL_BATCH_SIZE, MAX_LAYERS

    model = tmp_path / "edge.yaml"
    model.write_text(
        f"name: edge\nnum_layers: {MAX_LAYERS}\nhidden_size: 128\nnum_heads: 4\nseq_length: 128\nvocab_size: 256\n"
        f"precision: fp32\nglobal_batch_size: {MAX_GLOBAL_BATCH_SIZE}\n"
    )
    nodes = str(MAX_WORLD_SIZE // 8)
    started = time.monotonic()
    argv = ("plan", "--model", str(model), "--cluster", "dgx-a100-80gb", "--nodes", nodes, "--top", "1", "--json")
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert time.monotonic() - started < 15
    assert json.loads(out)["plans"][0]["plan"]["dp"] >= 1
    for argv, bound in (
        (["--nodes", str(MAX_WORLD_SIZE // 8 + 1)], "at most 1,048,576"),
        (["--global-batch-size", str(MAX_GLOBAL_BATCH_SIZE + 1)], "(4,294,967,296 samples)"),
    ):
        code, out, err = run_cli(capsys, "plan", "--model", str(model), "--cluster", "dgx-a100-80gb", *argv)
        assert code == 2 and err.count("\n") == 1 and bound in err, err
    model.write_text(model.read_text().replace(f"num_layers: {MAX_LAYERS}", f"num_layers: {MAX_LAYERS + 1}"))
    code, _, err = run_cli(capsys, "plan", "--model", str(model), "--cluster", "cpu")
    assert code == 2 and "num_layers must be at most 16,384" in err


@pytest.mark.pure
def test_a_mixed_cluster_file_beyond_the_bound_is_refused(capsys, tmp_path):
    """A cluster file of different devices is priced rank by rank: more than 8,192 devices is one line naming the bound."""
    path = tmp_path / "mixed.yaml"
    path.write_text(ANCHORED_CLUSTER.replace("nodes: 1\n    devices_per_node: 2", "nodes: 2049\n    devices_per_node: 2"))
    code, _, err = run_cli(capsys, "plan", "--model", "gpt-tiny", "--cluster", str(path))
    assert code == 2 and err.count("\n") == 1
    assert "has 8,196 devices; a cluster of different devices may have at most 8,192" in err
