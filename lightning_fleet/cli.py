"""The ``fleet`` command: ``fleet plan``, ``fleet estimate``, ``fleet calibrate`` and ``fleet launch`` (also ``python -m lightning_fleet``).

Every failure the user can cause ends in one line on stderr, ``fleet: error: ...``, and exit code 2: the line is at most
ERROR_CHARS characters (:func:`error_line`), every count is read in ASCII digits, and the sizes the planner loops over
are bounded (cluster.MAX_WORLD_SIZE, model.MAX_LAYERS, model.MAX_GLOBAL_BATCH_SIZE), so bad input is never a traceback,
a hang or a line of megabytes (issue 11's fuzz test, tests/test_cli_fuzz.py).

Imports the planning core, the runtimes' capabilities (pure) and, per command, what that command needs (export,
calibrate, launch, plotting; ``plan``/``estimate --module``: :mod:`lightning_fleet.offline`, which loads torch, so
``--model`` never does); imported by ``__main__`` and the ``fleet`` entry point only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import TYPE_CHECKING, Any, Sequence

from lightning_fleet.planning import (
    ClusterSpec,
    Constraints,
    Estimate,
    FleetError,
    ModelSpec,
    PartialPlan,
    Plan,
    PlanResult,
    RejectionKind,
    cluster_presets,
    estimate,
    load_cluster,
    load_model,
    model_presets,
    narrow,
    parse_partial_plan,
    parse_plan,
    plan,
)
from lightning_fleet.planning.cluster import GIB
from lightning_fleet.planning.overlap import OVERLAP_NAMES, Overlaps
from lightning_fleet.planning.search import explain_misfit, explain_tight, uneven_split_line
from lightning_fleet.planning.yamlspec import ascii_int, shown
from lightning_fleet.runtime import AUTO, RUNTIME_NAMES, RUNTIMES, capabilities_of
from lightning_fleet.runtime.base import Capabilities, ModuleHooks

if TYPE_CHECKING:
    from lightning_fleet.offline import OfflineModule

EXIT_USAGE = 2
EXIT_PIPE = 128 + 13
"""The status a shell reports for coreutils killed by SIGPIPE (13) when the reader of their output exits (``| head``)."""
ERROR_CHARS = 1000
"""Longest error line (``fleet: error: ...``): a longer message keeps its start and its end (what to do)."""
MAX_TIMEOUT_S = 7 * 24 * 3600
"""Longest ``fleet calibrate --timeout`` (a week; the measurement takes minutes)."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line with exit code 2, like every other fleet error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise FleetError(message)


def _integer(text: str) -> int:
    """argparse type: an integer in ASCII digits (``int()`` also takes '١٢', '１２' and ' 1_0 '), at most 18 of them."""
    try:
        return ascii_int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected an integer, got {shown(text)} ({err})") from None


def _seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0 and at most MAX_TIMEOUT_S, in ASCII (``float()`` takes 'nan')."""
    try:
        value = float(text) if text.isascii() else math.nan
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"expected seconds > 0 and <= {MAX_TIMEOUT_S}, got {shown(text)}")
    return value


def _add_specs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help=f"model YAML path or preset ({', '.join(model_presets())})")
    parser.add_argument("--cluster", required=True, help=f"cluster YAML path or preset ({', '.join(cluster_presets())})")
    parser.add_argument(
        "--global-batch-size",
        type=_integer,
        help="samples per optimizer step (default: the model file's; with --module the config's FleetStrategy "
        "global_batch_size, else the example batch's size x the world size, as strategy='fleet' defaults)",
    )
    parser.add_argument("--nodes", type=_integer, help="override the node count of a homogeneous cluster")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    parser.add_argument(
        "--runtime",
        default="any",
        metavar="{" + ",".join((*RUNTIME_NAMES, AUTO)) + "}",
        help="what must execute the plan: 'any' (default) plans and prices every layout the cost model knows; 'deepspeed' "
        "only what strategy='fleet' runs on DeepSpeed (no sp, no vpp, no selective recomputation, zero <= 1 and no tp "
        "or offload with pp, the default placement); 'torch' what it runs on torch's own stack (zero 0-3, hybrid sharding "
        "and tp: DDP, sharded optimizer steps, FSDP2, HSDP, DTensor; no pp, offload or sp); "
        "'auto' the fastest of those runtimes' best plans, as FleetStrategy(runtime='auto') chooses. For --model "
        "assuming the module provides fleet_tensor_parallel() and fleet_pipeline(), for --module with the hooks it has",
    )
    parser.add_argument(
        "--overlaps",
        metavar="NAMES",
        help="the communications the runtime hides behind compute, comma-separated ("
        + ", ".join(OVERLAP_NAMES) + "), or 'none', 'all', 'default' (the cost model's assumption: every gradient "
        "reduction and ZeRO-3's gathers); default: the --runtime's own ('any': 'default'; 'deepspeed': what DeepSpeed "
        "0.19.8 overlaps). Every plan is priced with the same",
    )
    own = parser.add_argument_group(
        "your own module, instead of --model",
        "Builds the class once on the meta device (no weights; on the CPU with a note when it cannot), profiles it on an "
        "example batch as strategy='fleet' does at fit (training_step; a plain nn.Module as module(batch), forward only) "
        "and plans that. No GPU and no process group needed.",
    )
    own.add_argument("--module", metavar="CLASS", help="the module's class: pkg.mod:Class, pkg.mod.Class or file.py:Class")
    own.add_argument("--init-args", metavar="MAPPING", help="its constructor's arguments as JSON or YAML, e.g. "
                     "'{num_layers: 24}' (over the config's)")
    own.add_argument("--config", metavar="FILE.yaml", help="a LightningCLI config: model (class_path/init_args, or the "
                     "arguments), data, trainer.precision, trainer.strategy.init_args.global_batch_size")
    own.add_argument("--batch", metavar="SPEC", help=f"the example batch: {BATCH_HELP}")
    own.add_argument("--datamodule", metavar="CLASS", help="a LightningDataModule whose first training batch is the example "
                     "batch (prepare_data and setup('fit') run; the data must be reachable); default: the config's data")
    own.add_argument("--datamodule-args", metavar="MAPPING", help="its constructor's arguments, JSON or YAML (over the config's)")
    own.add_argument("--precision", help="Lightning's spelling: 32-true (default), bf16-mixed, bf16-true, 16-mixed, 16-true "
                     "(default: the config's trainer.precision)")


_MODULE_FLAGS = ("module", "init_args", "config", "batch", "datamodule", "datamodule_args", "precision")
"""The options that plan the user's own module (lightning_fleet.offline) instead of a model file."""
BATCH_HELP = (
    'a tensor dtype[dims] ("long[8,512]"), a tuple "(long[8,512], long[8,512])", a list "[...]" or a mapping '
    '"{input_ids: long[8,512], labels: long[8,512]}", nested freely; dtypes are torch\'s names (float, bfloat16, half, '
    "long, int, bool, ...); the first dim is the batch; integer tensors are zeros, floating ones standard normal"
)
"""The --batch grammar (lightning_fleet.offline.parse_batch reads it), stated once, here, for --help."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``fleet`` command."""
    parser = _Parser(prog="fleet", description="Plan and estimate parallel layouts for large-model training.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    est = sub.add_parser("estimate", help="predict memory and step time of one plan")
    _add_specs(est)
    est.add_argument("--plan", required=True, help='plan string, e.g. "dp=4,tp=2,pp=1,zero=1,mbs=2"')

    cal = sub.add_parser("calibrate", help="measure this machine (microbenchmarks) and write a cluster YAML with fitted constants")
    cal.add_argument("--out", required=True, help="cluster YAML to write")
    cal.add_argument("--nproc-per-node", type=_integer, default=1,
                     help="processes (devices) to measure together on this machine (default 1)")
    cal.add_argument("--device", choices=("cpu", "cuda"), help="device kind (default: cuda when available)")
    cal.add_argument("--no-framework", action="store_true", help="skip the Lightning + DeepSpeed framework probe")
    cal.add_argument("--timeout", type=_seconds, default=900, help="seconds before the measurement is abandoned (default 900)")

    exp = sub.add_parser("export", help="write a checkpoint of any plan as one plain Lightning checkpoint (full fp32 weights)")
    exp.add_argument(
        "checkpoint",
        help="a FleetCheckpoint step-N dir (or the dir holding them: the newest verified), its state/ dir, "
        "or a trainer.save_checkpoint dir",
    )
    exp.add_argument("--out", required=True, help="file to write (load_from_checkpoint and torch.load(weights_only=True) read it)")

    run = sub.add_parser("launch", help="torchrun with fast, safe elastic defaults (takes torchrun's arguments; see fleet launch --help)",
                         add_help=False)
    run.add_argument("torchrun_args", nargs=argparse.REMAINDER)

    pln = sub.add_parser("plan", help="rank every plan and explain the choice")
    _add_specs(pln)
    pln.add_argument("--top", type=_integer, default=5, help="how many plans to show (default 5)")
    pln.add_argument("--plot", metavar="FILE.png", help="scatter of step time vs peak memory of every candidate")
    pln.add_argument("--zero-stages", default="0,1,2,3", help="ZeRO stages to consider, comma-separated")
    pln.add_argument("--max-tp", type=_integer, help="largest tensor-parallel degree")
    pln.add_argument("--max-pp", type=_integer, help="largest pipeline-parallel degree")
    pln.add_argument("--max-vpp", type=_integer, help="largest number of virtual pipeline stages (1: no interleaving)")
    pln.add_argument("--no-offload", action="store_true", help="never offload to host memory")
    pln.add_argument("--no-sp", action="store_true", help="never use sequence parallelism")
    pln.add_argument("--fix", default="", metavar="KEYS", help='axes to fix, e.g. "zero=1,mbs=4"; the planner chooses the rest')
    return parser


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Job:
    """What ``plan``/``estimate`` price: the model, the cluster, the module's hooks, and (for ``--module``) the
    profiled module whose report is printed above the plan."""

    model: ModelSpec
    cluster: ClusterSpec
    hooks: ModuleHooks
    offline: "OfflineModule | None" = None


def _load(args: argparse.Namespace) -> _Job:
    cluster = load_cluster(args.cluster)
    if args.nodes is not None:
        if args.nodes < 1:
            raise FleetError(f"--nodes must be >= 1, got {args.nodes}")
        cluster = cluster.with_nodes(args.nodes)
    if args.global_batch_size is not None and args.global_batch_size < 1:
        raise FleetError(f"--global-batch-size must be >= 1, got {args.global_batch_size}")
    given = [f"--{flag.replace('_', '-')}" for flag in _MODULE_FLAGS if getattr(args, flag) is not None]
    if args.model is not None and given:
        raise FleetError(f"--model plans a model file, {', '.join(given)} your own module: use one or the other")
    if args.model is None and args.module is None and args.config is None:
        raise FleetError("say what to plan: --model (a model YAML or preset) or --module pkg.mod:Class (your module)")
    if args.model is None:
        return _load_module(args, cluster)
    model = load_model(args.model)
    if args.global_batch_size is not None:
        model = dataclasses.replace(model, global_batch_size=args.global_batch_size)
    return _Job(model=model, cluster=cluster, hooks=ModuleHooks.assumed())


def _load_module(args: argparse.Namespace, cluster: ClusterSpec) -> _Job:
    """The user's module, profiled offline (lightning_fleet.offline loads torch; imported only here)."""
    from lightning_fleet.offline import ModuleRequest, profile_offline

    request = ModuleRequest(global_batch_size=args.global_batch_size, **{flag: getattr(args, flag) for flag in _MODULE_FLAGS})
    offline = profile_offline(request, world_size=cluster.world_size)
    return _Job(model=offline.spec, cluster=cluster, hooks=offline.hooks, offline=offline)


def _constraints(args: argparse.Namespace, runtime: Capabilities, hooks: ModuleHooks, fixed: PartialPlan) -> Constraints:
    try:
        zero = tuple(ascii_int(z.strip()) for z in args.zero_stages.split(",") if z.strip())
    except ValueError:
        raise FleetError(f"--zero-stages must be comma-separated integers, got {shown(args.zero_stages)}") from None
    for flag in ("max_tp", "max_pp", "max_vpp"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise FleetError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    base = runtime.constraints(hooks, allow_offload=not args.no_offload, max_tp=args.max_tp, max_pp=args.max_pp, zero_stages=zero)
    vpp_limits = [limit for limit in (base.max_vpp, args.max_vpp) if limit is not None]
    base = dataclasses.replace(base, max_vpp=min(vpp_limits, default=None), allow_sp=base.allow_sp and not args.no_sp,
                               overlaps=_overlaps(args, runtime))
    _refuse_unrunnable(runtime, fixed, hooks)
    return narrow(base, fixed)


def _overlaps(args: argparse.Namespace, runtime: Capabilities) -> Overlaps:
    """--overlaps as a value: the runtime's own when not given."""
    if args.overlaps is None:
        return runtime.overlaps
    text = args.overlaps.strip()
    named = {"none": Overlaps.NONE, "all": Overlaps.ALL, "default": Overlaps.DEFAULT}
    if text in named:
        return named[text]
    return Overlaps.of([name.strip() for name in text.split(",") if name.strip()])


def _refuse_unrunnable(runtime: Capabilities, plan: Plan | PartialPlan, hooks: ModuleHooks) -> None:
    """FleetError (one line: why) when ``runtime`` cannot execute ``plan`` for a module with ``hooks``."""
    why = runtime.refusal(plan, hooks)
    if why:
        raise FleetError(f"{why} (--runtime {runtime.name})")


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f}"


def _console():
    """A rich console; 160 columns when stdout is not a terminal, so plan strings are never cut. A reader that went
    away raises BrokenPipeError to :func:`main` (rich would exit with status 1 on its own)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError

    return _Console(width=None if sys.stdout.isatty() else 160)


def _print_estimate(e: Estimate, cluster: ClusterSpec) -> None:
    from rich.table import Table

    console = _console()
    console.print(f"[bold]{e.model.name}[/] on [bold]{cluster.name}[/] ({e.world_size} devices): {e.plan}")
    mem = Table("memory per device (worst stage)", "GiB", title=None)
    for name, value in e.memory.terms().items():
        mem.add_row(name, _gib(value))
    mem.add_row("[bold]total[/]", f"[bold]{_gib(e.memory.total_bytes)}[/] of {_gib(e.memory.limit_bytes)}")
    if e.memory.host_bytes:
        mem.add_row("host (offload)", f"{_gib(e.memory.host_bytes)} of {_gib(e.memory.host_limit_bytes)}")
    tim = Table("time per step", "s")
    for name, value in e.time.terms().items():
        tim.add_row(name, f"{value:.4g}")
    tim.add_row("[bold]step[/]", f"[bold]{e.time.step_s:.4g}[/]")
    console.print(mem, tim)
    if e.fits:
        verdict = "[green]fits[/]"
    elif e.memory.tight:
        verdict = f"[yellow]tight[/]: {explain_tight(e.memory)}"
    else:
        verdict = f"[red]does not fit[/]: {explain_misfit(e.memory)}"
    console.print(
        f"{verdict}; {e.samples_per_s:.4g} samples/s, {e.model_tflops_per_device:.1f} model TFLOP/s per device "
        f"({e.hardware_tflops_per_device:.1f} hardware)"
    )


def _print_plan(result: PlanResult, model: ModelSpec, cluster: ClusterSpec) -> None:
    from rich.table import Table

    console = _console()
    console.print(
        f"[bold]{model.name}[/] ({model.params / 1e9:.3g} B params, global batch {model.global_batch_size}) on "
        f"[bold]{cluster.name}[/] ({cluster.world_size} devices): {result.candidates} candidates, "
        f"{result.feasible} fit, searched in {result.seconds:.3f} s"
    )
    table = Table("#", "plan", "step s", "GiB/device", "TFLOP/s/dev", "largest time term")
    table.columns[1].overflow = "fold"
    for rank, e in enumerate(result.plans, 1):
        term, seconds = e.time.largest_term()
        table.add_row(
            str(rank),
            str(e.plan),
            f"{e.time.step_s:.4g}",
            f"{_gib(e.memory.total_bytes)}/{_gib(e.memory.limit_bytes)}",
            f"{e.model_tflops_per_device:.1f}",
            f"{term} {seconds:.3g} s",
        )
    console.print(table)
    if result.even_best is not None:
        console.print(uneven_split_line(result, cluster))
    if result.leave_out is not None:
        console.print(result.leave_out.line(result.best))
    if result.rejected:
        why = Table("not chosen", "why", title="runners-up, then misfits (closest first)")
        why.columns[0].overflow = "fold"
        slower = [r for r in result.rejected if r.kind is RejectionKind.SLOWER][:5]
        misfits = [r for r in result.rejected if r.kind is not RejectionKind.SLOWER][:5]
        for r in slower + misfits:
            why.add_row(r.plan, r.reason)
        console.print(why)


def _calibrate(args: argparse.Namespace) -> int:
    """Run lightning_fleet.calibrate.command in its own process(es): alone, or under torchrun on 127.0.0.1 for several."""
    import subprocess

    _check_calibration(args)
    module = ["-m", "lightning_fleet.calibrate.command", "--out", args.out] + (["--device", args.device] if args.device else [])
    module += ["--no-framework"] if args.no_framework else []
    launcher, env = [sys.executable], dict(os.environ)
    if args.nproc_per_node > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc-per-node={args.nproc_per_node}", "--rdzv-backend=c10d",
                     "--rdzv-endpoint=127.0.0.1:0", "--nnodes=1"]
        env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets for several processes, without its 4-line notice
    try:
        done = subprocess.run(launcher + module, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        raise FleetError(f"calibration did not finish within {args.timeout:.0f} s; rerun with a larger --timeout") from None
    if done.returncode != 0:
        raise FleetError(f"calibration failed (exit {done.returncode}); the measurement's last messages are above")
    return 0


def _check_calibration(args: argparse.Namespace) -> None:
    """What fleet calibrate would only find out in its measuring processes, after minutes: the process count, the device
    kind and where the file goes."""
    from lightning_fleet.elastic.launch import MAX_NPROC_PER_NODE

    if args.nproc_per_node < 1:
        raise FleetError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if args.nproc_per_node > MAX_NPROC_PER_NODE:
        raise FleetError(
            f"--nproc-per-node must be <= {MAX_NPROC_PER_NODE} (processes on this machine), got {args.nproc_per_node}"
        )
    _check_output_path(args.out, "--out", parents_made=True)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise FleetError("--device cuda: torch sees no CUDA device on this machine; use --device cpu")
        if args.nproc_per_node > torch.cuda.device_count():
            raise FleetError(
                f"--nproc-per-node {args.nproc_per_node} is more than the {torch.cuda.device_count()} CUDA devices here"
            )


def _check_output_path(path: str, flag: str, *, parents_made: bool = False) -> None:
    """FleetError unless ``path`` can be a file written later: not a directory, in a directory that exists (or, where
    the writer makes missing directories, ``parents_made``, below one) and that this user may write to."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        raise FleetError(f"{flag} {shown(path, 200)} is a directory: give a file name")
    parent = os.path.dirname(target)
    while parents_made and not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise FleetError(f"{flag} {shown(path, 200)}: {shown(parent, 200)} is not a directory that exists")
    if not os.access(parent, os.W_OK):
        raise FleetError(f"{flag} {shown(path, 200)}: directory {shown(parent, 200)} is not writable by this user")


def _export(args: argparse.Namespace) -> int:
    """``fleet export CHECKPOINT --out FILE``: one line saying what was written."""
    from lightning_fleet import noise
    from lightning_fleet.export import export_checkpoint

    noise.install()  # DeepSpeed's accelerator-detection warning on import
    out = export_checkpoint(args.checkpoint, args.out)
    import torch

    payload = torch.load(out, map_location="cpu", weights_only=True)
    params = sum(t.numel() for t in payload["state_dict"].values())
    print(f"{out}: {len(payload['state_dict'])} tensors, {params / 1e6:.3f} M values, plan {payload['lightning_fleet']['plan']}")
    return 0


def _run(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:  # everything after it is torchrun's, unparsed
        from lightning_fleet.elastic.launch import launch

        return launch(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "calibrate":
        return _calibrate(args)
    if args.command == "export":
        return _export(args)
    fixed = parse_partial_plan(args.fix) if args.command == "plan" else PartialPlan()  # a bad --fix fails before any build
    if getattr(args, "plot", None):
        from lightning_fleet.plotting import check_plot_path

        _check_output_path(args.plot, "--plot")
        check_plot_path(args.plot)
    job = _load(args)
    model, cluster = job.model, job.cluster
    if args.runtime == AUTO:
        return _auto(args, job, fixed)
    runtime = capabilities_of(args.runtime)
    cluster = cluster.for_runtime(runtime.name)  # its own measured framework overheads, where the cluster file has them
    if args.command == "estimate":
        chosen = parse_plan(args.plan, global_batch_size=model.global_batch_size)
        _refuse_unrunnable(runtime, chosen, job.hooks)
        result = estimate(model, cluster, chosen, overlaps=_overlaps(args, runtime))
        _report(job, args, notes=())
        if args.json:
            print(json.dumps(_with_module(result.to_dict(), job)))
        else:
            _print_estimate(result, cluster)
        return 0
    if args.top < 1:
        raise FleetError(f"--top must be >= 1, got {args.top}")
    notes: tuple[str, ...] = ()
    if job.offline is not None:
        fixed, notes = job.offline.pinned(fixed)
    constraints = _constraints(args, runtime, job.hooks, fixed)
    if job.offline is not None and job.offline.profile.batch_dependent is not False:  # as the strategy decides
        constraints = dataclasses.replace(constraints, search_dp_mbs=False)
    result = plan(model, cluster, top=args.top, exhaustive=bool(args.plot), constraints=constraints)
    if args.plot:
        from lightning_fleet.plotting import plot_candidates

        plot_candidates(result, model, cluster, args.plot)
    _report(job, args, notes=notes)
    if args.json:
        print(json.dumps(_with_module(result.to_dict(), job, notes)))
    else:
        _print_plan(result, model, cluster)
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def _auto(args: argparse.Namespace, job: _Job, fixed: PartialPlan) -> int:
    """``--runtime auto``: each runtime's estimate of the plan (``estimate``) or its best plan (``plan``), the fastest
    shown after one line comparing them, as FleetStrategy(runtime='auto') chooses (a tie goes to the first in the
    table); FleetError naming each runtime's refusal when none executes it."""
    model, cluster = job.model, job.cluster
    notes: tuple[str, ...] = ()
    if job.offline is not None and args.command == "plan":
        fixed, notes = job.offline.pinned(fixed)
    runs: list[tuple[float, str, Any]] = []
    refusals: list[str] = []
    for runtime in (r.capabilities for r in RUNTIMES):
        priced_on = cluster.for_runtime(runtime.name)
        try:
            if args.command == "estimate":
                chosen = parse_plan(args.plan, global_batch_size=model.global_batch_size)
                _refuse_unrunnable(runtime, chosen, job.hooks)
                found: Any = estimate(model, priced_on, chosen, overlaps=_overlaps(args, runtime))
            else:
                constraints = _constraints(args, runtime, job.hooks, fixed)
                if job.offline is not None and job.offline.profile.batch_dependent is not False:
                    constraints = dataclasses.replace(constraints, search_dp_mbs=False)
                found = plan(model, priced_on, top=args.top, constraints=constraints)
        except FleetError as err:
            refusals.append(f"{runtime.name}: {err}")
            continue
        runs.append(((found if args.command == "estimate" else found.best).time.step_s, runtime.name, found))
    if not runs:
        raise FleetError("no runtime executes this: " + "; ".join(refusals))
    step_s, name, best = min(runs, key=lambda run: run[0])
    others = [f"{other} {s:.4g} s/step ({s / step_s:.2f}x)" for s, other, _ in runs if other != name] + refusals
    line = f"runtime  {name}: predicted {step_s:.4g} s/step; " + ("; ".join(others) or "the only runtime that executes it")
    _report(job, args, notes=notes)
    if args.json:
        print(json.dumps({**_with_module(best.to_dict(), job, notes), "runtime": name, "runtime_line": line}))
    elif args.command == "estimate":
        print(line)
        _print_estimate(best, cluster)
    else:
        print(line)
        _print_plan(best, model, cluster)
    return 0


def _report(job: _Job, args: argparse.Namespace, notes: Sequence[str]) -> None:
    """The profiled module's report (what was built, the batch, the profiler's lines, the pinned axes), above the plan
    table; nothing for a model file or with --json (the JSON object holds it)."""
    if job.offline is not None and not args.json:
        print("\n".join((*job.offline.lines, *notes)))


def _with_module(obj: dict, job: _Job, notes: Sequence[str] = ()) -> dict:
    """The JSON object, with ``"module"`` (lightning_fleet.offline.OfflineModule.to_dict) for --module."""
    if job.offline is None:
        return obj
    module = job.offline.to_dict()
    return {**obj, "module": {**module, "report": [*module["report"], *notes]}}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fleet`` console script; returns the exit code."""
    try:
        code = _run(argv)
        sys.stdout.flush()  # a reader that went away (``| head``) shows here, not at interpreter exit
        return code
    except FleetError as err:
        print(error_line(str(err)), file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_PIPE


def error_line(message: str) -> str:
    """``fleet: error: message`` as one printable line of at most ERROR_CHARS characters: line breaks become spaces,
    other control characters escapes, and a longer line keeps its start and its last 300 characters."""
    text = " ".join(message.splitlines())
    if len(text) > 4 * ERROR_CHARS:
        text = f"{text[: 2 * ERROR_CHARS]} ... {text[-ERROR_CHARS:]}"
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    line = f"fleet: error: {text}"
    return line if len(line) <= ERROR_CHARS else f"{line[: ERROR_CHARS - 305]} ... {line[-300:]}"


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it again at exit raises nothing (the reader of the pipe has gone)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (captured output)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
