"""The sage_fp16 kernel compiled by NVRTC here (no GPU needed): Turing's tensor-core instructions in its key loop,
no traps, no spills, and registers and shared memory within an RTX 2080 Ti's (sm_75) limits.

The SASS is read with the cuobjdump the triton wheel ships (h3serve needs no CUDA toolkit); the PTX for compute_75
(what bench/sage_turing.py has the driver JIT-compile on a lent GPU) is read as text.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from h3serve.runtime.kernels import nvrtc_cache, sage, sage_prepare

# sm_75's limits: registers per thread and per SM, static shared memory per block without opt-in
MAX_REGISTERS, SM_REGISTERS, SHARED_BYTES = 255, 65536, 48 * 1024
# per 64-key tile: Q.K^T is 2 m-tiles x 8 key tiles x 8 16-dim steps of m8n8k16; P.V 8 key chunks x 16 channel
# tiles of m16n8k8
IMMA_PER_TILE, HMMA_PER_TILE = 2 * 8 * 8, 8 * 16


def cuobjdump() -> Path:
    triton = pytest.importorskip("triton")
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not path.exists():
        pytest.skip(f"no cuobjdump at {path}")
    return path


@pytest.fixture(scope="module", params=["sm_75", "sm_90"])
def cubin(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sass") / f"sage-{request.param}.cubin"
    path.write_bytes(nvrtc_cache.compile_source(sage.KERNEL, sage.source(), request.param))
    return path


def sass(path: Path) -> list[tuple[int, str]]:
    """(address, instruction) of every SASS line."""
    text = subprocess.run([cuobjdump(), "-sass", path], capture_output=True, text=True, check=True).stdout
    return [(int(a, 16), op.strip()) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]


def key_loop(code: list[tuple[int, str]]) -> list[str]:
    """The instructions of the kernel's loop: from the target of its one backward branch to that branch."""
    loops = [
        (int(target[1], 16), address)
        for address, op in code
        if (target := re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", op)) and int(target[1], 16) < address
    ]
    assert len(loops) == 1, f"expected one loop (the key tiles), found backward branches {loops}"
    start, end = loops[0]
    return [op for address, op in code if start <= address <= end]


def test_the_key_loop_runs_q_k_on_imma_8816_and_p_v_on_hmma_1688_with_no_trap(cubin):
    code = sass(cubin)
    loop = key_loop(code)
    assert sum("IMMA.8816.S8.S8" in op for op in loop) == IMMA_PER_TILE
    assert sum("HMMA.1688.F32" in op for op in loop) == HMMA_PER_TILE
    assert sum(("IMMA" in op or "HMMA" in op) for _, op in code) == IMMA_PER_TILE + HMMA_PER_TILE  # all in the loop
    assert not [op for _, op in code if "BPT.TRAP" in op]
    assert not [op for _, op in code if re.match(r"(@!?P\d\s+)?(LDGSTS|LDSM)", op)]  # no cp.async, no ldmatrix


def test_no_spills_and_registers_and_shared_memory_within_sm75_limits(cubin):
    text = subprocess.run([cuobjdump(), "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    usage = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}
    assert usage["STACK"] == 0 and usage["LOCAL"] == 0, usage  # nothing spilled to local memory
    assert usage["REG"] <= MAX_REGISTERS, usage
    warp_registers = -(-usage["REG"] * 32 // 256) * 256  # allocated per warp in units of 256
    assert warp_registers * sage.THREADS // 32 <= SM_REGISTERS, usage  # one block fits an SM
    assert usage["SHARED"] <= SHARED_BYTES, usage
    print(cubin.name, usage)


def test_the_compute_75_ptx_is_turings_with_only_its_mma_forms():
    ptx = nvrtc_cache.compile_source(sage.KERNEL, sage.source(), "compute_75").decode().rstrip("\0")
    assert re.search(r"^\.target sm_75$", ptx, re.M)
    forms = set(re.findall(r"mma\.sync\.aligned\.[\w.]+", ptx))
    assert forms == {
        "mma.sync.aligned.m8n8k16.row.col.s32.s8.s8.s32",
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32",
    }
    for sm80_only in ("cp.async", "ldmatrix", "bf16", "f16x2.f32"):
        assert sm80_only not in ptx


def test_the_kernel_and_its_pre_pass_agree_on_the_block_sizes():
    defined = dict(re.findall(r"^#define (\w+) (\d+)", sage.source().decode(), re.M))
    python = {name: getattr(sage_prepare, name) for name in ("HEAD_DIM", "BLOCK_Q", "WARP_ROWS", "BLOCK_K")}
    assert {name: int(defined[name]) for name in python} == python
    assert int(defined["THREADS"]) == sage.THREADS == sage_prepare.BLOCK_Q // sage_prepare.WARP_ROWS * 32
