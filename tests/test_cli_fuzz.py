"""Malformed input to fleet plan / estimate / calibrate / launch: every case is exit code 2 and one line.

A table of hand-written cases plus mutations generated from the shipped presets (gpt-tiny, cpu): each key deleted or
given twice; each value replaced by a list, a mapping, a huge number, non-ASCII digits, a negative number, NaN, an
alias bomb or nesting deeper than the parser allows; bad bytes, empty and non-regular files; every count option and plan
key given zero, negative, huge, fractional, empty, spaced and non-ASCII values; torchrun's options with values it would
only refuse after starting (or never). Each runs in-process through ``lightning_fleet.cli.main`` and must end with exit
code 2 and exactly one line, ``fleet: error: ...``, of at most 1000 characters, within 10 s and 200 MB of Python
allocations (tracemalloc); a handful run through a fresh interpreter too, for the exit code, no traceback and the peak
resident memory. Before issue 11 these were tracebacks (RecursionError, UnicodeDecodeError, ZeroDivisionError,
OverflowError), hangs (divisors of 10**30), a 351 MB "line" (an alias bomb quoted by repr), silent acceptance
(duplicate keys, '١٢'), torchrun started on a script that does not exist, or a real calibration run with --timeout nan.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_fleet.cli import main
from lightning_fleet.planning.cluster import ClusterSpec, DeviceGroup
from lightning_fleet.planning.model import TransformerSpec

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ROOT / "lightning_fleet" / "planning" / "presets"
PREFIX = "fleet: error: "
MAX_LINE = 1000
MAX_SECONDS = 10.0
MAX_TRACED_BYTES = 200 * 2**20
MAX_RSS_BYTES = {"launch": 400 * 2**20}  # a fresh interpreter that imports torch (torchrun's parser) holds ~225 MB
DEFAULT_RSS_BYTES = 200 * 2**20

MODEL = yaml.safe_load((PRESETS / "models" / "gpt-tiny.yaml").read_text())
CLUSTER = yaml.safe_load((PRESETS / "clusters" / "cpu.yaml").read_text())
BOMB, SMALL_BOMB, DEEP = "__ALIAS_BOMB__", "__SMALL_ALIAS_BOMB__", "__DEEP_NESTING__"
FIFO, DIRECTORY = object(), object()


def alias_bomb(levels: int = 8) -> str:
    """A YAML flow list of ``levels`` anchors, each nine aliases of the one before: 300 bytes, 9**8 values written out."""
    parts = ['&a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        before, name = chr(ord("a") + i - 1), chr(ord("a") + i)
        parts.append(f"&{name} [" + ",".join([f"*{before}"] * 9) + "]")
    return "[" + ", ".join(parts) + "]"


def render(data: dict[str, Any]) -> str:
    """YAML of ``data`` with the BOMB, SMALL_BOMB and DEEP markers replaced by their text."""
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    return text.replace(SMALL_BOMB, alias_bomb(6)).replace(BOMB, alias_bomb()).replace(DEEP, "[" * 1200 + "]" * 1200)


@dataclasses.dataclass(frozen=True)
class Case:
    """One malformed input: the fleet arguments ({dir} is the folder holding ``files``), the files it reads, and a few
    words the error line must contain (the key or option at fault), if any."""

    id: str
    argv: tuple[str, ...]
    files: tuple[tuple[str, Any], ...] = ()
    names: str = ""


# --- spec files: mutations of the presets -------------------------------------------------------------------------


def leaves(data: Any, path: tuple = ()) -> list[tuple]:
    """Paths (keys and indices) to the scalars of a YAML mapping."""
    if isinstance(data, dict):
        return [p for key, value in data.items() for p in leaves(value, (*path, key))]
    if isinstance(data, list):
        return [p for i, value in enumerate(data) for p in leaves(value, (*path, i))]
    return [path]


def replaced(data: Any, path: tuple, value: Any) -> Any:
    """A deep copy of ``data`` with the value at ``path`` replaced."""
    copy = yaml.safe_load(yaml.safe_dump(data))
    node = copy
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return copy


def required(*classes: type) -> set[str]:
    """The YAML keys without a default in the spec dataclasses (what a file must give)."""
    return {
        f.name for cls in classes for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name != "groups"
    }


ANY_VALUE = {"list": [1, 2], "mapping": {"x": 1}, "huge": 10**40, "alias-bomb": BOMB, "alias-bomb-531k": SMALL_BOMB, "deep": DEEP}
"""Replacements that no scalar field of a spec accepts. The small bomb (9**6 values written out) is under the loader's
expansion bound, so the field's check quotes it (a 4 MB repr before issue 11)."""
SAYS = {"huge": "at line", "alias-bomb": "aliases expand it", "deep": "nest"}
"""What the line says instead of the key, for replacements the YAML loader refuses (it names the line and column)."""
NUMBER_VALUE = {"arabic-digits": "١٢", "fullwidth-digits": "１２", "negative": -1, "nan": float("nan"), "text": "12abc"}
"""Replacements that no number field of a spec accepts (all are counts, sizes, rates or non-negative constants)."""
NAME_VALUE = {"nul": "gpt\x00tiny", "escape": "\x1b[2Jcleared", "newline": "two\nlines", "blank": "  ", "100kB": "x" * 100_000}
"""Replacements that no name (a label printed in reports) accepts: control characters, nothing, or 100 kB (whose table
title took 84 s to print before issue 22)."""


def spec_cases(kind: str, data: dict[str, Any], keys_required: set[str]) -> list[Case]:
    """Every mutation of one spec file, each planned with the other kind's preset."""
    def argv(name: str) -> tuple[str, ...]:
        path = name if name.startswith("/") else f"{{dir}}/{name}"
        if kind == "model":
            return ("plan", "--model", path, "--cluster", "cpu")
        return ("plan", "--model", "gpt-tiny", "--cluster", path)

    cases: list[Case] = []

    def add(label: str, text: str | bytes, names: str = "") -> None:
        name = f"{kind}-{len(cases)}.yaml"  # names no key: the line must
        cases.append(Case(f"{kind}/{label}", argv(name), ((name, text),), names))

    for path in leaves(data):
        where = ".".join(map(str, path))
        numeric = isinstance(data_at(data, path), (int, float)) and not isinstance(data_at(data, path), bool)
        named = path == ("name",)
        for label, value in {**ANY_VALUE, **(NUMBER_VALUE if numeric else {}), **(NAME_VALUE if named else {})}.items():
            add(f"{where}/{label}", render(replaced(data, path, value)), SAYS.get(label, str(path[-1])))
    for key in data:
        add(f"{key}/given-twice", render(data) + yaml.safe_dump({key: data[key]}, sort_keys=False), f"key {key!r} is given twice")
        if key in keys_required:
            add(f"{key}/missing", render({k: v for k, v in data.items() if k != key}), f"missing key {key!r}")
    text = render(data)
    bad_bytes = {
        "latin-1": text.encode() + "# café\n".encode("latin-1"),
        "nul-byte": text.encode().replace(b"name:", b"na\x00me:", 1),
        "utf-16": text.encode("utf-16"),
        "binary": bytes(range(256)) * 8,
        "empty": b"",
        "list": b"- 1\n- 2\n",
        "scalar": b"42\n",
        "self-alias": b"name: &a [1, *a]\n",
        "tab-indent": ("\t" + text).encode(),
        "unclosed": b"name: [1, 2\n",
        "python-tag": b"name: !!python/object/apply:os.system ['true']\n",
        "huge-literal": text.replace(str(next(v for v in data.values() if type(v) is int)), "9" * 5000, 1).encode(),
    }
    for label, content in bad_bytes.items():
        add(f"file/{label}", content)
    cases.append(Case(f"{kind}/file/fifo", argv("fifo.yaml"), (("fifo.yaml", FIFO),)))
    cases.append(Case(f"{kind}/file/directory", argv("folder.yaml"), (("folder.yaml", DIRECTORY),)))
    cases.append(Case(f"{kind}/file/dev-zero", argv("/dev/zero")))
    cases.append(Case(f"{kind}/file/too-large", argv(f"{kind}-large.yaml"),
                      ((f"{kind}-large.yaml", text + "# " + "x" * (1 << 20) + "\n"),), "larger than 1 MiB"))
    return cases


def data_at(data: Any, path: tuple) -> Any:
    for key in path:
        data = data[key]
    return data


MODEL_CASES = spec_cases("model", MODEL, required(TransformerSpec))
CLUSTER_CASES = spec_cases("cluster", CLUSTER, required(ClusterSpec, DeviceGroup))

# --- options and plan strings -----------------------------------------------------------------------------------------

BAD_COUNTS = {"zero": "0", "negative": "-1", "text": "x", "arabic": "١٢", "fullwidth": "１", "fraction": "1.5", "empty": "",
              "spaced": " 1", "underscore": "1_0", "huge": "9" * 30}
"""Values no count option (>= 1) accepts."""
PLAN_BASE = {"dp": "2", "tp": "1", "pp": "1", "zero": "1", "mbs": "1", "gas": "8"}
"""A plan gpt-tiny runs on the cpu preset (2 devices, global batch 16)."""


def plan_text(**changes: str | None) -> str:
    fields = {**PLAN_BASE, **changes}
    return ",".join(f"{k}={v}" for k, v in fields.items() if v is not None)


def option_cases() -> list[Case]:
    cases = []
    specs = ("--model", "gpt-tiny", "--cluster", "cpu")
    for option in ("--nodes", "--global-batch-size", "--top", "--max-tp", "--max-pp", "--max-vpp"):
        for label, value in BAD_COUNTS.items():
            cases.append(Case(f"plan/{option}/{label}", ("plan", *specs, option, value), names=option))
    for option in ("--nodes", "--global-batch-size"):
        for label, value in BAD_COUNTS.items():
            argv = ("estimate", *specs, "--plan", plan_text(), option, value)
            cases.append(Case(f"estimate/{option}/{label}", argv, names=option))
    for key in ("dp", "tp", "pp", "mbs", "gas", "vpp"):
        for label, value in BAD_COUNTS.items():
            if label not in ("spaced", "empty"):  # the plan string strips spaces; an empty value is its own case below
                argv = ("estimate", *specs, "--plan", plan_text(**{key: value}))
                cases.append(Case(f"estimate/--plan/{key}={label}", argv, names=key))
                cases.append(Case(f"plan/--fix/{key}={label}", ("plan", *specs, "--fix", f"{key}={value}"), names=key))
    for label, value in {"five": "5", "negative": "-1", "text": "x", "arabic": "١"}.items():
        cases.append(Case(f"estimate/--plan/zero={label}", ("estimate", *specs, "--plan", plan_text(zero=value)), names="zero"))
    plans = {
        "no-dp": plan_text(dp=None), "dp-twice": plan_text() + ",dp=2", "empty-value": "dp=", "no-equals": "dp",
        "unknown-key": plan_text() + ",flavour=3", "dp_mbs-zero": "dp=2,mbs=1,dp_mbs=0/0",
        "stage_layers-arabic": "dp=2,stage_layers=١/2",
        "sp-maybe": plan_text() + ",sp=maybe", "order-twice": plan_text() + ",order=dp-dp-pp", "huge-dp": "dp=" + "9" * 5000,
        "recompute-bogus": plan_text() + ",recompute=most", "empty-items": plan_text() + ",,,,",
        "trailing-comma": plan_text() + ",",
    }
    for label, text in plans.items():
        cases.append(Case(f"estimate/--plan/{label}", ("estimate", *specs, "--plan", text)))
    for label, value in {"negative": "-1", "text": "0,x", "arabic": "١", "huge": "9" * 30, "only-commas": ",,"}.items():
        cases.append(Case(f"plan/--zero-stages/{label}", ("plan", *specs, "--zero-stages", value)))
    for label, value in {"bogus": "bogus", "empty-name": "dp_grad_reduce,,bogus"}.items():
        cases.append(Case(f"plan/--overlaps/{label}", ("plan", *specs, "--overlaps", value)))
    cases.append(Case("plan/--plot/missing-dir", ("plan", *specs, "--plot", "{dir}/no/such/dir/plot.png"), names="--plot"))
    cases.append(Case("plan/--plot/directory", ("plan", *specs, "--plot", "{dir}"), names="--plot"))
    cases.append(Case("plan/--plot/unsupported-extension", ("plan", *specs, "--plot", "{dir}/p.txt"), names="--plot"))
    cases.append(Case("plan/--plot/no-extension", ("plan", *specs, "--plot", "{dir}/plot"), names="--plot"))
    cases.append(Case("plan/--fix/empty-items", ("plan", *specs, "--fix", "dp=2,,,,"), names="empty item"))
    for label, name in {"nul": "gpt-tiny\x00", "escape": "gpt-tiny\x1b[2J", "100kB": "m" * 100_000}.items():
        cases.append(Case(f"plan/--model/{label}", ("plan", "--model", name, "--cluster", "cpu"), names="model file or preset"))
        cases.append(Case(f"plan/--cluster/{label}", ("plan", "--model", "gpt-tiny", "--cluster", name), names="cluster file or preset"))
    cases.append(Case("plan/--runtime/bogus", ("plan", *specs, "--runtime", "bogus")))
    cases.append(Case("plan/--model-and-module", ("plan", *specs, "--module", "x:Y")))
    cases.append(Case("plan/--init-args/alias-bomb", ("plan", "--cluster", "cpu", "--module", "torch.nn.Linear",
                                                      "--init-args", "{a: " + alias_bomb() + "}")))
    cases.append(Case("plan/--init-args/twice", ("plan", "--cluster", "cpu", "--module", "torch.nn.Linear",
                                                 "--init-args", "{in_features: 4, in_features: 5}"), names="in_features"))
    config = "trainer:\n  strategy:\n    init_args:\n      global_batch_size: " + alias_bomb() + "\n"
    cases.append(Case("plan/--config/alias-bomb", ("plan", "--cluster", "cpu", "--config", "{dir}/config-bomb.yaml"),
                      (("config-bomb.yaml", config),)))
    linear = ("plan", "--cluster", "cpu", "--module", "torch.nn.Linear", "--init-args", "{in_features: 4, out_features: 4}")
    batches = {"arabic-dim": "float[١,4]", "huge-dim": f"float[{'9' * 5000},4]", "zero-dim": "float[0,4]",
               "deep": "(" * 3000 + "float[2,4]" + ")" * 3000, "unclosed": "float[2,4", "bogus-dtype": "floot[2,4]"}
    for label, batch in batches.items():
        cases.append(Case(f"plan/--batch/{label}", (*linear, "--batch", batch), names="--batch"))
    cases.append(Case("plan/--config/fifo", ("plan", "--cluster", "cpu", "--config", "{dir}/fifo.yaml"), (("fifo.yaml", FIFO),)))
    for label, value in {"text": "x", "arabic": "١", "zero": "0", "huge": "9" * 30, "over-the-bound": "100000"}.items():
        argv = ("calibrate", "--out", "{dir}/c.yaml", "--nproc-per-node", value)
        cases.append(Case(f"calibrate/--nproc-per-node/{label}", argv))
    for label, value in {"nan": "nan", "inf": "inf", "negative": "-1", "zero": "0", "text": "soon", "arabic": "١٠",
                         "overflow": "1e400", "over-a-week": "1e9"}.items():
        argv = ("calibrate", "--out", "{dir}/c.yaml", "--timeout", value)
        cases.append(Case(f"calibrate/--timeout/{label}", argv, names="--timeout"))
    undecodable = {"model": ("plan", "--model", "\udcff\udcfe.yaml", "--cluster", "cpu"),
                   "plan": ("estimate", *specs, "--plan", "dp=\udcff"), "nodes": ("plan", *specs, "--nodes", "\udcff")}
    for label, argv in undecodable.items():
        cases.append(Case(f"{argv[0]}/non-utf8-argv/{label}", argv))  # bytes that are not UTF-8 reach Python as surrogates
    cases.append(Case("calibrate/--out/directory", ("calibrate", "--out", "{dir}"), names="--out"))
    below_a_file = ("calibrate", "--out", "{dir}/plain.txt/c.yaml")
    cases.append(Case("calibrate/--out/below-a-file", below_a_file, (("plain.txt", "x"),), "--out"))
    cases.append(Case("calibrate/--device/bogus", ("calibrate", "--out", "{dir}/c.yaml", "--device", "tpu")))
    return cases


def launch_cases() -> list[Case]:
    """torchrun's options with values refused before torchrun starts (no training is started by any of them)."""
    script = "{dir}/train.py"
    bad = {
        "nproc=-1": ["--nproc-per-node=-1"], "nproc=abc": ["--nproc-per-node=abc"], "nproc=0": ["--nproc-per-node=0"],
        "nproc=arabic": ["--nproc-per-node=١"], "nproc=huge": ["--nproc-per-node=" + "9" * 30],
        "nproc=2000": ["--nproc-per-node=2000"], "nnodes=0": ["--nnodes=0"], "nnodes=1:0": ["--nnodes=1:0"],
        "nnodes=a:b": ["--nnodes=a:b"], "nnodes=1:2:3": ["--nnodes=1:2:3"],
        "nnodes=huge": ["--nnodes=" + "9" * 30], "nnodes=fullwidth": ["--nnodes=１"], "nnodes=empty": ["--nnodes="],
        "max-restarts=x": ["--max-restarts=x"], "max-restarts=-1": ["--max-restarts=-1"],
        "max-restarts=arabic": ["--max-restarts=٣"],
        "node-rank=-1": ["--node-rank=-1"], "master-port=70000": ["--master-port=70000"], "master-port=x": ["--master-port=x"],
        "monitor-interval=nan": ["--monitor-interval=nan"], "monitor-interval=0": ["--monitor-interval=0"],
        "monitor-interval=inf": ["--monitor-interval=inf"], "shutdown-timeout=-5": ["--shutdown-timeout=-5"],
        "endpoint=::::": ["--rdzv-endpoint=::::"], "endpoint-port-huge": ["--rdzv-endpoint=127.0.0.1:99999999"],
        "endpoint-port-text": ["--rdzv-endpoint=127.0.0.1:http"], "endpoint-host-space": ["--rdzv-endpoint=my host:29400"],
        "rdzv-conf=garbage": ["--rdzv-conf=garbage"], "rdzv-conf=empty-key": ["--rdzv-conf==1"],
        "rdzv-conf=no-value": ["--rdzv-conf=join_timeout="], "rdzv-conf=join-x": ["--rdzv-conf=join_timeout=x"],
        "rdzv-conf=join-huge": ["--rdzv-conf=join_timeout=" + "9" * 15], "rdzv-conf=read-0": ["--rdzv-conf=read_timeout=0"],
        "rdzv-conf=keep-alive-arabic": ["--rdzv-conf=keep_alive_max_attempt=٣"],
        "rdzv-conf=keep-alive-2": ["--rdzv-conf=keep_alive_max_attempt=2"],
        "local-ranks-filter=a": ["--local-ranks-filter=a,b"], "redirects=9": ["--redirects=9"], "tee=x": ["--tee=x"],
        "start-method=bogus": ["--start-method=bogus"], "unknown-option": ["--bogus=1"],
    }
    never_run = (("train.py", "print('never run')\n"),)
    cases = [Case(f"launch/{label}", ("launch", *options, script), never_run) for label, options in bad.items()]
    cases += [
        Case("launch/no-script", ("launch", "--nproc-per-node=1")),
        Case("launch/missing-script", ("launch", "--nproc-per-node=1", "{dir}/no-such-train.py"), names="does not exist"),
        Case("launch/script-is-a-directory", ("launch", "{dir}/folder.yaml"), (("folder.yaml", DIRECTORY),), "does not exist"),
        Case("launch/no-python-missing", ("launch", "--no-python", "no-such-command-fleet-fuzz"), names="no such executable"),
    ]
    return cases


CASES = MODEL_CASES + CLUSTER_CASES + option_cases() + launch_cases()
SUBPROCESS_CASES = ["model/num_layers/alias-bomb", "model/num_layers/deep", "model/file/fifo", "cluster/file/dev-zero",
                    "estimate/--plan/dp=zero", "plan/--nodes/huge", "calibrate/--timeout/nan", "launch/nproc=huge",
                    "launch/missing-script", "model/name/100kB"]


@pytest.fixture(scope="module")
def files_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every file the cases read, written once."""
    folder = tmp_path_factory.mktemp("fuzz")
    for case in CASES:
        for name, content in case.files:
            path = folder / name
            if path.exists():
                continue
            if content is FIFO:
                os.mkfifo(path)
            elif content is DIRECTORY:
                path.mkdir()
            else:
                path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return folder


@pytest.fixture(scope="module")
def warm_imports() -> None:
    """torch (for --module) and torchrun's parser (for launch), imported before the cases are timed and traced: a first
    import under tracemalloc takes ~15 s here, and is no part of the command (the fresh-interpreter tests time it)."""
    import lightning_fleet.offline  # noqa: F401
    import torch.distributed.run  # noqa: F401


def resolved(case: Case, folder: Path) -> list[str]:
    return [arg.replace("{dir}", str(folder)) for arg in case.argv]


def check_line(case: Case, code: int, output: str, seconds: float) -> None:
    """Exit code 2 and exactly one bounded line naming what is wrong."""
    lines = output.splitlines()
    assert code == 2, f"{case.id}: exit {code}: {output[-2000:]}"
    assert len(lines) == 1 and lines[0].strip(), f"{case.id}: {len(lines)} lines: {output[:2000]}"
    assert lines[0].startswith(PREFIX), lines[0][:300]
    assert len(lines[0]) <= MAX_LINE, f"{case.id}: a line of {len(lines[0])} characters"
    assert case.names in lines[0], f"{case.id}: {case.names!r} not in {lines[0]!r}"
    assert seconds < MAX_SECONDS, f"{case.id}: {seconds:.1f} s"


@pytest.mark.pure
def test_there_are_at_least_100_cases_with_unique_ids():
    assert len(CASES) >= 100
    assert len({c.id for c in CASES}) == len(CASES)
    assert set(SUBPROCESS_CASES) <= {c.id for c in CASES}


@pytest.mark.pure
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_input_is_one_bounded_line_and_exit_2(case, files_dir, warm_imports, capsys):
    """In-process: exit code 2, one line ``fleet: error: ...`` of at most 1000 characters naming the key or option, in
    under 10 s and 200 MB of Python allocations."""
    argv = resolved(case, files_dir)
    tracemalloc.start()
    started = time.monotonic()
    try:
        code = main(argv)
    finally:
        seconds = time.monotonic() - started
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    out, err = capsys.readouterr()
    check_line(case, code, out + err, seconds)
    assert out == "", out[:500]
    assert peak < MAX_TRACED_BYTES, f"{case.id}: {peak / 2**20:.0f} MB allocated"


@pytest.mark.pure
@pytest.mark.parametrize("kind, data", [("model", MODEL), ("cluster", CLUSTER)])
def test_the_unmutated_files_plan(kind, data, tmp_path, capsys):
    """The files the mutations start from, written the same way, plan: each error above comes from its mutation."""
    path = tmp_path / f"{kind}.yaml"
    path.write_text(render(data))
    model, cluster = (str(path), "cpu") if kind == "model" else ("gpt-tiny", str(path))
    argv = ["plan", "--model", model, "--cluster", cluster]
    assert main([*argv, "--json", "--top", "1"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith('{"plans": ')


@pytest.mark.pure
@pytest.mark.parametrize("case_id", ["model/name/100kB", "cluster/name/100kB", "plan/--model/100kB", "plan/--cluster/100kB"])
def test_a_100kb_name_is_answered_within_a_second(case_id, files_dir, capsys):
    """A 100 kB model or cluster name (in its file or as the --model/--cluster argument) is one line in under a second.
    Before issue 22: the file's name was accepted and printed as the table's title in 84 s (rich's highlighting is
    quadratic in it), the argument was an OSError traceback ("File name too long")."""
    case = next(c for c in CASES if c.id == case_id)
    started = time.monotonic()
    code = main(resolved(case, files_dir))
    seconds = time.monotonic() - started
    out, err = capsys.readouterr()
    check_line(case, code, out + err, seconds)
    assert seconds < 1.0, f"{case_id}: {seconds:.2f} s"


LAUNCHER = (
    "import os, subprocess, sys; proc = subprocess.Popen(sys.argv[2:]); _, status, usage = os.wait4(proc.pid, 0); "
    "open(sys.argv[1], 'w').write(f'{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss}')"
)
"""Runs the command and writes its exit code and peak resident KB: a child's ru_maxrss counts the memory of the process
it was forked from (Linux keeps the high-water mark across exec), so the command is forked from this small interpreter,
not from pytest (hundreds of MB once torch is imported)."""


def run_fleet(argv: list[str], cwd: Path, timeout: float) -> tuple[int, str, float, int]:
    """``python -m lightning_fleet argv`` in its own session: exit code, stdout and stderr together, seconds and peak
    resident bytes; killed with its process group at ``timeout``."""
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile() as output:
        report = Path(tmp) / "report"
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(report), sys.executable, "-m", "lightning_fleet", *argv],
                                stdout=output, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"fleet {' '.join(argv)[:200]} still ran after {timeout} s")
        seconds = time.monotonic() - started
        code, rss_kb = map(int, report.read_text().split())
        output.seek(0)
        text = output.read(4 * MAX_LINE).decode(errors="replace")
    return code, text, seconds, rss_kb * 1024


@pytest.mark.unit
@pytest.mark.parametrize("case_id", SUBPROCESS_CASES)
def test_a_fresh_interpreter_exits_2_with_one_line(case_id, files_dir):
    """Through ``python -m lightning_fleet``: exit code 2, one line, no traceback, bounded time and resident memory."""
    case = next(c for c in CASES if c.id == case_id)
    code, output, seconds, rss = run_fleet(resolved(case, files_dir), files_dir, timeout=60)
    check_line(case, code, output, seconds)
    assert "Traceback" not in output
    bound = MAX_RSS_BYTES.get(case.argv[0], DEFAULT_RSS_BYTES)
    assert rss < bound, f"{case.id}: {rss / 2**20:.0f} MB resident"


PURE_PYTHON_CASES = ["model/num_layers/deep", "cluster/device.memory_gib/deep", "model/num_layers/given-twice",
                     "cluster/device/given-twice", "model/num_layers/alias-bomb", "cluster/nodes/alias-bomb-531k",
                     "model/file/huge-literal", "model/file/self-alias", "model/file/python-tag", "cluster/file/nul-byte"]


@pytest.mark.pure
@pytest.mark.parametrize("case_id", PURE_PYTHON_CASES)
def test_the_pure_python_parser_refuses_the_same(case_id, files_dir, monkeypatch, capsys):
    """Where libyaml is not installed the loader is PyYAML's pure-Python one, whose deep nesting is a RecursionError
    instead of a YAMLError: the same cases are one line and exit 2 with it."""
    from lightning_fleet.planning import yamlspec

    class PurePython(yamlspec.Strict, yaml.SafeLoader):
        pass

    PurePython.add_constructor("tag:yaml.org,2002:int", PurePython.construct_yaml_int)
    monkeypatch.setattr(yamlspec, "StrictLoader", PurePython)
    case = next(c for c in CASES if c.id == case_id)
    started = time.monotonic()
    code = main(resolved(case, files_dir))
    out, err = capsys.readouterr()
    check_line(case, code, out + err, time.monotonic() - started)
