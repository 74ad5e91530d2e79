"""What this machine's processor runs, for the tests whose cases depend on it (each skip names the reason).

fp16 on a CPU needs oneDNN's fp16 kernels (AVX512-FP16 or AMX-FP16: recent Intel Xeons; AMD EPYC has neither), the test
DeepSpeed's CPU accelerator makes (deepspeed/accelerator/cpu_accelerator.py ``is_fp16_supported``); without them
DeepSpeed refuses fp16 and strategy "fleet" refuses ``precision="16-mixed"`` before the fit starts.
"""

from __future__ import annotations

import re

import pytest
import torch

FP16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
"""This CPU has fp16 kernels: DeepSpeed trains fp16 on it."""

NO_FP16 = "this CPU has no fp16 kernels (oneDNN needs AVX512-FP16 or AMX-FP16), so DeepSpeed cannot train fp16 here"

needs_fp16 = pytest.mark.skipif(not FP16, reason=NO_FP16)
"""Mark a test that trains fp16."""


def runs_here(entry: str) -> bool:
    """A test worker's plan entry (``[model:][precision@]plan``) can train on this CPU."""
    return FP16 or re.search(r"(^|:)16-(mixed|true)@", entry) is None
