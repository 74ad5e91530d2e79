"""Shared fixtures (small specs every test can build without files) and the tier check: every test carries exactly one
of the tier markers registered in pyproject.toml, so that ``pytest -m <tier>`` selects every test of that tier."""

from __future__ import annotations

import os

import pytest

from lightning_fleet.planning import (
    Calibration,
    ClusterSpec,
    DeviceGroup,
    DeviceSpec,
    HostSpec,
    LinkSpec,
    PeakTflops,
    TransformerSpec,
    transformer_model,
)


def make_cluster(nodes: int = 1, devices_per_node: int = 8, memory_gib: float = 80, host: bool = True, **calib) -> ClusterSpec:
    """A homogeneous A100-like cluster of the given size."""
    return ClusterSpec(
        name=f"test-{nodes}x{devices_per_node}",
        groups=(
            DeviceGroup(
                nodes=nodes,
                devices_per_node=devices_per_node,
                device=DeviceSpec(name="gpu", memory_gib=memory_gib, peak_tflops=PeakTflops(bf16=312, fp16=312, fp32=19.5)),
            ),
        ),
        intra_node=LinkSpec(bandwidth_GBps=300, latency_us=5),
        inter_node=LinkSpec(bandwidth_GBps=25, latency_us=10),
        host=HostSpec(memory_gib=1024, pcie_GBps=25) if host else None,
        calibration=Calibration(**calib),
    )


def make_model(layers: int = 8, hidden: int = 1024, heads: int = 16, seq: int = 1024, vocab: int = 32000, gbs: int = 32, precision: str = "bf16-mixed"):
    """A GPT-style ModelSpec."""
    return transformer_model(
        TransformerSpec(
            name=f"gpt-{layers}x{hidden}",
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            seq_length=seq,
            vocab_size=vocab,
            precision=precision,
            global_batch_size=gbs,
        )
    )


@pytest.fixture
def cluster() -> ClusterSpec:
    return make_cluster()


@pytest.fixture
def model():
    return make_model()


@pytest.fixture
def restore_environment():
    """An in-process Trainer writes RANK, LOCAL_RANK, MASTER_PORT, PL_* into os.environ: undo it for later tests
    (modules with in-process Trainers use it for every test: ``pytestmark = pytest.mark.usefixtures(...)``)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


TIERS = ("pure", "unit", "multiprocess", "elastic", "gpu")
"""The tier markers, fast first; their meaning is in pyproject.toml's [tool.pytest.ini_options] markers."""


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects anything: a test without a tier fails every run, not only the full one
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse the collection when a test has no tier marker or several; skip the gpu tier where CUDA is missing."""
    wrong = []
    for item in items:
        tiers = [tier for tier in TIERS if item.get_closest_marker(tier)]
        if len(tiers) != 1:
            wrong.append(f"{item.nodeid}: {'no tier marker' if not tiers else 'several tiers: ' + ', '.join(tiers)}")
    if wrong:
        raise pytest.UsageError(
            f"every test needs exactly one tier marker of {', '.join(TIERS)} (see pyproject.toml), as a module's "
            f"`pytestmark = pytest.mark.<tier>` or a test's `@pytest.mark.<tier>`:\n  " + "\n  ".join(wrong)
        )
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu and not _cuda_available():
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def _cuda_available() -> bool:
    """Whether this machine has a CUDA device (torch is imported only when a gpu test was collected)."""
    import torch

    return torch.cuda.is_available()
