"""Plots of planner results (matplotlib, an optional extra: ``pip install lightning_fleet[plot]``).

Imports matplotlib (the ``plot`` extra) and the planning core; imported by the CLI only (``fleet plan --plot``), which
checks the output path with :func:`check_plot_path` before it plans.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_fleet.planning import ClusterSpec, FleetError, ModelSpec, PlanResult
from lightning_fleet.planning.cluster import GIB
from lightning_fleet.planning.estimate import Hardware, estimate_with
from lightning_fleet.planning.yamlspec import shown


def _pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend, or FleetError saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FleetError("--plot needs matplotlib: pip install 'lightning_fleet[plot]'") from None
    return plt


def check_plot_path(path: str | Path) -> None:
    """FleetError unless matplotlib can write ``path``: its extension names one of the formats matplotlib writes (it
    picks the format by the extension, and a name without one would be written elsewhere, as ``NAME.png``)."""
    from matplotlib.backend_bases import FigureCanvasBase

    _pyplot()
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    suffix = Path(path).suffix.lower().removeprefix(".")
    if suffix not in formats:
        given = f"extension {shown('.' + suffix)}" if suffix else "no extension"
        raise FleetError(f"--plot {shown(str(path), 200)} has {given}: give a file name ending in one of "
                         f"{', '.join('.' + f for f in formats)} (e.g. plan.png)")


def plot_candidates(result: PlanResult, model: ModelSpec, cluster: ClusterSpec, path: str | Path) -> Path:
    """Scatter every priced candidate's step time against its peak memory, with the device limit and the chosen plan."""
    plt = _pyplot()
    hw = Hardware.of(cluster, model)
    misfits = [estimate_with(model, hw, p) for p in result.misfit_plans]
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    fits = result.all_feasible
    ax.scatter([e.memory.total_bytes / GIB for e in fits], [e.time.step_s for e in fits], s=10, alpha=0.5, label=f"fits ({len(fits)})")
    if misfits:
        ax.scatter(
            [e.memory.total_bytes / GIB for e in misfits],
            [e.time.step_s for e in misfits],
            s=10,
            marker="x",
            color="tab:red",
            alpha=0.5,
            label=f"does not fit ({len(misfits)} families, lightest member)",
        )
    limit = hw.memory_bytes / GIB
    ax.axvline(limit, color="black", linestyle="--", label=f"device memory {limit:.0f} GiB")
    best = result.best
    ax.scatter([best.memory.total_bytes / GIB], [best.time.step_s], s=120, marker="*", color="gold", edgecolor="black", zorder=5, label="chosen")
    ax.annotate(str(best.plan), (best.memory.total_bytes / GIB, best.time.step_s), fontsize=7, xytext=(6, -12), textcoords="offset points")
    ax.set_xlabel("predicted peak memory per device (GiB)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(f"{model.name} on {cluster.name} ({cluster.world_size} devices)")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out
