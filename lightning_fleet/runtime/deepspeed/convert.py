"""``python -m lightning_fleet.runtime.deepspeed.convert ARGS``: DeepSpeed's ``ds_to_universal`` with every file it reads
unpickled by the restricted unpickler as the kind its name says (DeepSpeed 0.19.8 checkpoint/ds_to_universal.py calls
``torch.load(weights_only=False)`` in a dozen places, on the source shards and on the temporary slices it writes
itself), and a refusal as one line on stderr with exit code 2.

This is the one place that replaces ``torch.load`` process-wide, and it may: the process is our own, started by
runtime/deepspeed/universal.py (``make_universal``) for this conversion alone and running nothing else (its extract and
merge workers are 1, so ds_to_universal runs them in this process). Imports deepspeed and elastic/safe_load.py.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_fleet.elastic.layout import KIND_UNIVERSAL_FRAGMENT, kind_of
from lightning_fleet.elastic.safe_load import load_file
from lightning_fleet.planning import FleetError


def converter_load(f: Any, map_location: Any = None, **_: Any) -> Any:
    """``torch.load`` as ds_to_universal calls it: the file read as the kind its name says, and the temporary slices
    ds_to_universal writes (``<param>/<state>.<tp>.<dp>``, no ``.pt``) as universal fragments."""
    path = Path(f)
    kind = kind_of(path.as_posix())
    if kind == "data" and not path.name.endswith(".pt"):
        kind = KIND_UNIVERSAL_FRAGMENT
    return load_file(path, kind=kind, map_location="cpu" if map_location is None else map_location)


def main(argv: list[str]) -> int:
    """Run ds_to_universal with ``argv``, every ``torch.load`` of this process read by :func:`converter_load`."""
    sys.argv = ["ds_to_universal", *argv]
    torch.load = converter_load  # this process is the conversion's alone (module docstring)
    try:
        runpy.run_module("deepspeed.checkpoint.ds_to_universal", run_name="__main__", alter_sys=True)
    except FleetError as err:
        print(f"lightning_fleet: error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
