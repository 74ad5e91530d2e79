"""Shared fixtures: small specs that every tier-1 test can build without files."""

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
