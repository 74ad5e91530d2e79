"""``python -m lightning_fleet.runtime.deepspeed.convert ARGS``: DeepSpeed's ``ds_to_universal`` with every file it reads
unpickled by the restricted unpickler (DeepSpeed 0.19.8 checkpoint/ds_to_universal.py loads with
``weights_only=False``), and a refusal as one line on stderr with exit code 2.

Run by runtime/deepspeed/universal.py (``make_universal``) in a subprocess; imports deepspeed and elastic/safe_load.py.
"""

from __future__ import annotations

import runpy
import sys

from lightning_fleet.elastic.safe_load import restricted
from lightning_fleet.planning import FleetError


def main(argv: list[str]) -> int:
    """Run ds_to_universal with ``argv`` inside :func:`~lightning_fleet.elastic.safe_load.restricted`."""
    sys.argv = ["ds_to_universal", *argv]
    try:
        with restricted():
            runpy.run_module("deepspeed.checkpoint.ds_to_universal", run_name="__main__", alter_sys=True)
    except FleetError as err:
        print(f"lightning_fleet: error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
