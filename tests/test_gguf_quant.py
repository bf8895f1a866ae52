"""bench/checkpoint_files.py's torch quantiser gives the bytes of the gguf package's own, so the GGUFs the benchmark
quantises on a GPU are the files gguf would write."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from bench.checkpoint_files import quantize

BLOCK = 32


def hard_rows() -> np.ndarray:
    """Random float32 rows, and rows made to hit each rule: all zeros, one value in an otherwise zero block, scales
    past fp16's range and below it, values on a rounding boundary, a block whose largest magnitude comes twice with
    both signs (Q4_0 takes the first), and a row of one value repeated."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((64, 8 * BLOCK)).astype(np.float32)
    rows[1] = 0.0
    rows[2, :BLOCK] = 0.0
    rows[2, 5] = -3.0
    rows[3] *= np.float32(3e37)  # fp16 scale overflows to inf
    rows[4] *= np.float32(1e-30)  # fp16 scale flushes to zero
    rows[5] = rng.integers(-127, 128, rows.shape[1]) + np.float32(0.5)  # Q8_0's halves, rounded away from zero
    rows[5, ::BLOCK] = 127.0  # with a scale of exactly 1
    rows[6, :BLOCK] = np.linspace(-8, 8, BLOCK, dtype=np.float32)
    rows[7, :BLOCK] = rng.standard_normal(BLOCK).astype(np.float32) * 0.1
    rows[7, 3], rows[7, 9] = 2.0, -2.0
    rows[8, BLOCK:] = -7.25
    rows[9] = np.float32(np.finfo(np.float32).max) * rng.uniform(-1, 1, rows.shape[1]).astype(np.float32)
    rows[10] = rng.uniform(-1, 1, rows.shape[1]).astype(np.float32) ** 9  # many values far below their block's scale
    return rows


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
    ),
]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # gguf's, on the inf scales asked for
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_the_torch_quantiser_gives_ggufs_bytes(kind, device):
    """On the CPU and on a GPU, where the benchmark quantises (CUDA rounds some divisions otherwise)."""
    rows = hard_rows()
    expected = gguf.quants.quantize(rows, gguf.GGMLQuantizationType[kind])
    got = quantize(torch.from_numpy(rows).to(device), kind).cpu()
    assert got.dtype == torch.uint8 and tuple(got.shape) == expected.shape
    mismatched = np.argwhere(got.numpy() != expected)
    assert mismatched.size == 0, f"bytes differ at (row, byte) {mismatched[:5].tolist()}"


def test_the_torch_quantiser_takes_bf16_weights_as_float32():
    """The benchmark quantises the bf16 weights: the values gguf is given as float32 (exact for bf16)."""
    weights = torch.randn(16, 4 * BLOCK, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for kind in ("Q8_0", "Q4_0"):
        expected = gguf.quants.quantize(weights.float().numpy(), gguf.GGMLQuantizationType[kind])
        assert np.array_equal(quantize(weights, kind).numpy(), expected)
