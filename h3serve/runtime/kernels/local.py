"""Attention kernels installed here, run through diffusers' `flash_4_hub` backend and its context parallelism.

diffusers 0.42.1 reaches FlashAttention 4 through a hub-kernel slot (`_HUB_KERNELS_REGISTRY`) that it
fills by downloading; h3serve never downloads, so the slot is filled with a locally installed kernel:
- `flash4`: FlashAttention 4 (the `flash-attn-4` package, Hopper and newer), bf16, same error as cuDNN;
- `cudnn_fp8`: cuDNN's FP8 attention with finer scaling around it (h3serve/runtime/kernels/fp8_attention.py);
- `sage`: h3serve's SageAttention kernel, INT8 Q.K and FP16 P.V, compiled by NVRTC for GPUs from sm_75
  (h3serve/runtime/kernels/sage.py).
Either runs as an opaque custom op, which keeps the compiled blocks whole (fullgraph). diffusers registers
`flash_4_hub` without context parallelism; the backend is registered again here with Ulysses (the
sequence split by heads: each rank runs the plain kernel on all rows of its heads), so a sharded DiT group
can use these kernels too. Ring attention needs the kernel's log-sum-exp, which they do not return.
The slot is one per process: binding another kernel moves every model on that backend to it (a process
serves one model; the benches switch on purpose, and it is logged).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from h3serve.runtime.kernels import fp8_attention, sage, slot

log = logging.getLogger("h3serve.local_kernels")
FLASH4 = "flash4"


def _flash4_kernel(q, k, v, softmax_scale=None, causal=False):
    return torch.ops.h3serve.flash4(q, k, v, slot.softmax_scale(q, softmax_scale, causal))


@torch.library.custom_op("h3serve::flash4", mutates_args=())
def flash4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """(batch, rows, heads, head_dim) attention without a mask, through FlashAttention 4."""
    from flash_attn.cute import flash_attn_func

    out = flash_attn_func(q, k, v, softmax_scale=scale, causal=False)
    return out[0] if isinstance(out, tuple) else out


@flash4.register_fake
def _(q, k, v, scale):
    return torch.empty_like(q)


@dataclass(frozen=True)
class LocalKernel:
    module: str  # what must import for the kernel to run
    package: str  # what to install when it does not
    kernel: Callable  # (q, k, v, softmax_scale, causal) on (batch, rows, heads, head_dim)
    capability: tuple[int, int]  # the oldest NVIDIA compute capability it runs on
    build_check: Callable[[tuple[int, int]], None] | None = None  # whether the installed build runs on this GPU

    def check(self, name: str) -> None:
        """Raise RuntimeError, with the reason, unless the kernel can run in this process."""
        try:
            importlib.import_module(self.module)
        except ImportError as exc:
            raise RuntimeError(f"attention backend {name!r} needs the {self.package} installed: {exc}") from exc
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() < self.capability:
            raise RuntimeError(
                f"attention backend {name!r} needs an NVIDIA GPU of compute capability "
                f"{'.'.join(map(str, self.capability))} or newer"
            )
        if self.build_check:
            self.build_check(torch.cuda.get_device_capability())


KERNELS = {
    FLASH4: LocalKernel(
        "flash_attn.cute", "flash-attn-4 package (and its CUTLASS DSL libraries)", _flash4_kernel, (9, 0)
    ),
    fp8_attention.NAME: LocalKernel("cudnn", "nvidia-cudnn-frontend package", fp8_attention.attention, (9, 0)),
    sage.NAME: LocalKernel(
        "cuda.bindings.nvrtc",
        "cuda-bindings and nvidia-cuda-nvrtc packages (torch's CUDA wheels depend on both)",
        sage.attention,
        sage.CAPABILITY,
        sage.check_build,
    ),
}


def bind(name: str) -> None:
    """Check that kernel `name` can run here, then install it."""
    KERNELS[name].check(name)
    install(KERNELS[name].kernel)


def install(kernel: Callable) -> None:
    """Put `kernel` (q, k, v, softmax_scale, causal; (batch, rows, heads, head_dim)) in the slot, whose
    backend is registered here with Ulysses."""
    from diffusers.models.attention_dispatch import (
        _HUB_KERNELS_REGISTRY,
        AttentionBackendName,
        _AttentionBackendRegistry,
    )

    slot = _HUB_KERNELS_REGISTRY[AttentionBackendName.FLASH_4_HUB]
    if slot.kernel_fn not in (None, kernel):
        log.warning(
            "attention kernel %s replaces %s in this process",
            getattr(kernel, "__name__", "?"),
            getattr(slot.kernel_fn, "__name__", "?"),
        )
    slot.kernel_fn = kernel
    _AttentionBackendRegistry.register(AttentionBackendName.FLASH_4_HUB, supports_context_parallel=True)(slot_attention)


def use(model: torch.nn.Module) -> None:
    """Route every attention processor of `model` to the slot (diffusers' own setter insists on the `kernels`
    hub client for this backend, which h3serve does not use)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_attention_backend"):
            processor._attention_backend = AttentionBackendName.FLASH_4_HUB
    _AttentionBackendRegistry.set_active_backend(AttentionBackendName.FLASH_4_HUB)


def slot_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    return_lse: bool = False,
    _parallel_config=None,
) -> torch.Tensor:
    """diffusers' backend function for the slot: the kernel itself, or under Ulysses between the all-to-alls."""
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    if attn_mask is not None or return_lse:
        raise ValueError("the local attention kernels take no mask and return no log-sum-exp (no ring attention)")
    if _parallel_config is None:
        return _slot_kernel()(q=query, k=key, v=value, softmax_scale=scale, causal=is_causal)
    if _parallel_config.context_parallel_config.ring_degree > 1:
        raise ValueError(
            "ring attention needs the kernel's log-sum-exp, which the local kernels do not return; "
            "split the sequence with Ulysses"
        )
    return _templated_context_parallel_attention(
        query,
        key,
        value,
        None,
        0.0,
        is_causal,
        scale,
        False,
        False,
        forward_op=_forward_op,
        backward_op=None,
        _parallel_config=_parallel_config,
    )


def _forward_op(
    ctx,
    query,
    key,
    value,
    attn_mask,
    dropout_p,
    is_causal,
    scale,
    enable_gqa,
    return_lse,
    _save_ctx=True,
    _parallel_config=None,
):
    """One rank's share under Ulysses: all rows, its heads (inference: nothing is saved for a backward)."""
    return _slot_kernel()(q=query, k=key, v=value, softmax_scale=scale, causal=is_causal)


def _slot_kernel() -> Callable:
    from diffusers.models.attention_dispatch import _HUB_KERNELS_REGISTRY, AttentionBackendName

    kernel = _HUB_KERNELS_REGISTRY[AttentionBackendName.FLASH_4_HUB].kernel_fn
    assert kernel is not None  # set before the backends that call this are registered
    return kernel
