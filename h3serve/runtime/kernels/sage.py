"""`sage`: h3serve's own SageAttention kernel (sage_fp16), INT8 Q.K^T and FP16 P.V on tensor cores from sm_75.

The attention that made the seeds' 4 x RTX 2080 Ti box work: on sm_75 no fused bf16 SDPA kernel exists, so
bf16 attention falls to MATH, which materialises the S x S scores. No package serves Sage on sm_75 either:
Triton dropped Turing's tensor cores in 3.3 (an int8 `tl.dot` for sm_75 does not compile at all, so
`sageattention` 1.x fails there) and SageAttention 2.x builds no sm_75 kernel. So the kernel is written here
(h3serve/runtime/kernels/sage_fp16/attention.cu: m8n8k16 IMMA for Q.K^T, m16n8k8 HMMA with fp32 accumulation
for P.V, only instructions Turing has), compiled at first use by NVRTC for the card's own architecture and kept
on disk (h3serve/runtime/kernels/nvrtc_cache.py): a pip install needs no nvcc. The torch pre-pass
(h3serve/runtime/kernels/sage_prepare.py) smooths K and quantises; the kernel launches through cuda-bindings
on torch's current stream, all inside the `h3serve::sage` custom op, so torch.compile, FSDP2 and Ulysses (the
local slot, h3serve/runtime/kernels/local.py) see one opaque op. bf16 in, bf16 out (the input dtype returned).

It runs on any NVIDIA GPU from sm_75. On sm_80+ a SageAttention 2.x build stays choosable through diffusers'
own backend names (e.g. `_sage_qk_int8_pv_fp16_cuda`). H3SERVE_SAGE_TARGET forces the NVRTC target:
`compute_75` gives Turing's PTX, which the driver JIT-compiles for a newer card, so an H100 runs (and checks
the numbers of) the sm_75 code path; bench/sage_turing.py does that.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from importlib import resources

import torch

from h3serve.runtime.kernels import nvrtc_cache, sage_prepare, slot

log = logging.getLogger("h3serve.sage")
NAME = "sage"
KERNEL = "sage_fp16_attention"
CAPABILITY = (7, 5)  # the oldest GPU with int8 (m8n8k16) and fp16 (m16n8k8) mma
TARGET_ENV = "H3SERVE_SAGE_TARGET"  # e.g. compute_75: Turing's PTX, JIT-compiled by the driver on a newer card
THREADS = 128  # the kernel's block: 4 warps


def source() -> bytes:
    return resources.files("h3serve.runtime.kernels").joinpath("sage_fp16/attention.cu").read_bytes()


def target_for(capability: tuple[int, int]) -> str:
    """The NVRTC target: the card's own CUBIN, unless H3SERVE_SAGE_TARGET names another."""
    return os.environ.get(TARGET_ENV) or f"sm_{capability[0]}{capability[1]}"


@dataclass(frozen=True)
class Kernel:
    function: object  # cuda.bindings.driver.CUfunction
    binary: nvrtc_cache.Binary
    ptx_version: int  # the virtual architecture it was compiled from (75 for compute_75 PTX)
    binary_version: int  # the architecture the card runs it as (the driver's JIT target for PTX)

    def describe(self, device: torch.device) -> str:
        capability = torch.cuda.get_device_capability(device)
        forced = f", forced by {TARGET_ENV}" if os.environ.get(TARGET_ENV) else ""
        return (
            f"attention kernel {KERNEL} (INT8 Q.K^T on m8n8k16 IMMA, FP16 P.V on m16n8k8 HMMA, fp32 accumulation) "
            f"on {torch.cuda.get_device_name(device)} (sm_{capability[0]}{capability[1]}): {self.binary.target}"
            f"{forced}, run as sm_{self.binary_version}; binary {self.binary.origin()}"
        )


@functools.cache
def kernel(device_index: int, target: str) -> Kernel:
    """The kernel loaded into `device_index`'s primary context (torch's) from `target`'s binary."""
    from cuda.bindings import driver

    binary = nvrtc_cache.load(KERNEL, source(), target)
    _make_current(device_index)
    image = ctypes.create_string_buffer(binary.image, len(binary.image))
    (module,) = _checked(driver.cuModuleLoadData(ctypes.addressof(image)), "cuModuleLoadData")
    (function,) = _checked(driver.cuModuleGetFunction(module, KERNEL.encode()), "cuModuleGetFunction")
    attribute = driver.CUfunction_attribute
    (ptx,) = _checked(driver.cuFuncGetAttribute(attribute.CU_FUNC_ATTRIBUTE_PTX_VERSION, function), "PTX version")
    (sass,) = _checked(driver.cuFuncGetAttribute(attribute.CU_FUNC_ATTRIBUTE_BINARY_VERSION, function), "version")
    loaded = Kernel(function, binary, ptx, sass)
    log.info("%s", loaded.describe(torch.device("cuda", device_index)))
    return loaded


def check_build(capability: tuple[int, int]) -> None:
    """RuntimeError, with the reason, unless NVRTC compiles the kernel for this GPU and the driver loads it
    (the start log then names the kernel, where its binary came from and the card)."""
    target = target_for(capability)
    if not (match := nvrtc_cache.TARGET.match(target)):
        raise RuntimeError(f"attention backend {NAME!r}: {TARGET_ENV}={target!r} is not sm_XY or compute_XY")
    architecture, card = int(match[2]), capability[0] * 10 + capability[1]
    if architecture > card or architecture < CAPABILITY[0] * 10 + CAPABILITY[1]:
        raise RuntimeError(f"attention backend {NAME!r}: target {target} cannot run on sm_{card}")
    try:
        supported = nvrtc_cache.supported_architectures()
    except Exception as exc:  # cuda-bindings raises its own error types when the library is missing
        raise RuntimeError(
            f"attention backend {NAME!r} compiles its kernel at first use with NVRTC, which cannot be loaded "
            f"(install nvidia-cuda-nvrtc, which torch's CUDA wheels depend on): {exc}"
        ) from exc
    if architecture not in supported:
        raise RuntimeError(
            f"attention backend {NAME!r}: NVRTC {nvrtc_cache.nvrtc_version()} cannot compile for {target} "
            f"(it supports {', '.join(map(str, supported))})"
        )
    kernel(torch.cuda.current_device(), target)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None, causal: bool = False
) -> torch.Tensor:
    """(batch, rows, heads, 128) attention without a mask; returns q's dtype."""
    return torch.ops.h3serve.sage(q, k, v, slot.softmax_scale(q, softmax_scale, causal))


@torch.library.custom_op("h3serve::sage", mutates_args=())
def sage(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    loaded = kernel(device, target_for(torch.cuda.get_device_capability(device)))
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    launch(loaded, sage_prepare.prepare(q, k, v, scale), out)
    return out.to(q.dtype)


@sage.register_fake
def _(q, k, v, scale):
    return torch.empty_like(q)


def launch(loaded: Kernel, prepared: sage_prepare.Prepared, out: torch.Tensor) -> None:
    """Run the kernel on torch's current stream, writing `out` (batch, rows, heads, 128) bf16."""
    from cuda.bindings import driver

    p = prepared
    if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.shape != (p.batch, p.rows, p.heads, 128):
        raise ValueError(f"sage_fp16 writes a contiguous bf16 (batch, rows, heads, 128) tensor, not {out.shape}")
    _make_current(out.device.index)
    tensors = (p.q, p.q_scale, p.k, p.k_scale, p.shift, p.vt, p.v_scale, out)
    values = [ctypes.c_void_p(t.data_ptr()) for t in tensors] + [ctypes.c_int(n) for n in (p.rows, p.heads, p.n_pad)]
    pointers = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
    stream = driver.CUstream(torch.cuda.current_stream(out.device).cuda_stream)
    grid = (p.n_pad // sage_prepare.BLOCK_Q, p.batch * p.heads, 1)
    _checked(
        driver.cuLaunchKernel(loaded.function, *grid, THREADS, 1, 1, 0, stream, ctypes.addressof(pointers), 0),
        "cuLaunchKernel",
    )


def _make_current(device_index: int) -> None:
    """Make torch's context for the device current on this thread (a thread torch never set a device on has
    none), so the module loads into, and the launch runs in, the context torch's tensors and streams live in."""
    from cuda.bindings import driver

    _checked(driver.cuCtxSetCurrent(_primary_context(device_index)), "cuCtxSetCurrent")


@functools.cache
def _primary_context(device_index: int):
    """The device's primary context, the one torch's runtime uses (retained once per process)."""
    from cuda.bindings import driver

    _checked(driver.cuInit(0), "cuInit")
    (device,) = _checked(driver.cuDeviceGet(device_index), "cuDeviceGet")
    return _checked(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")[0]


def _checked(result: tuple, call: str) -> tuple:
    """cuda-bindings return (status, *values): the values, or RuntimeError naming the call and the error."""
    from cuda.bindings import driver

    status, *values = result
    if int(status) != 0:
        _, text = driver.cuGetErrorString(status)
        raise RuntimeError(f"{call} failed: {status!r} ({text.decode() if text else '?'})")
    return tuple(values)
