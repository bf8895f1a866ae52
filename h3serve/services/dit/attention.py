"""The DiT's attention backend: explicit, checked on this device and dtype at start, never MATH when long.

The field notes' biggest lesson: PyTorch SDPA silently falls back to the MATH kernel, which
materialises the S x S score matrix and runs out of memory on a long packed sequence. So the
backend is set by name (diffusers checks the package), probed once with the model's head shape
and dtype on the rank's device (a kernel that cannot run fails the start with its reason), and
`native` on a GPU runs with MATH disabled above `max_math_tokens`.

Before any probe, the backend is checked against the GPU's compute capability: on sm_75 (the seeds' RTX 2080 Ti)
no fused bf16 SDPA kernel exists, so `native` and the `_native_*` backends are refused there with the reason, and
`sage` (h3serve's own INT8 Q.K / FP16 P.V kernel, compiled by NVRTC at first use) is what runs; without a GPU,
NVRTC or cuda-bindings it is refused with the reason, never replaced. The start log names the backend, the kernels
this GPU has and, for `sage`, where its binary came from (h3serve/runtime/kernels/sage.py).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from h3serve.model import rules
from h3serve.runtime.kernels import local as local_kernels

log = logging.getLogger("h3serve.dit.attention")
FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
PROBE_TOKENS = 256
MATERIALISING = ("_native_math", "flex")  # S x S scores in memory (flex: without torch.compile)
SDPA = ("native", "_native_cudnn", "_native_flash", "_native_efficient")
# The oldest compute capability on which each diffusers backend's kernel takes bf16: PyTorch's flash,
# memory-efficient and cuDNN SDPA kernels and flash-attn 2 from sm_80; FlashAttention 3 and SageAttention's
# fp8 P.V kernels on sm_90 / sm_89 only; SageAttention 2.x's fp16 P.V kernels (CUDA and Triton, diffusers' names)
# from sm_80 (2.x builds no sm_75 kernel, and Triton >= 3.3 no Turing tensor cores). The local kernels carry their
# own (h3serve/runtime/kernels/local.py): `sage` there is h3serve's kernel, from sm_75.
BF16_CAPABILITY = {
    **dict.fromkeys(SDPA, (8, 0)),
    "flash": (8, 0),
    "flash_varlen": (8, 0),
    "_flash_3": (9, 0),
    "_flash_varlen_3": (9, 0),
    "_sage_qk_int8_pv_fp16_cuda": (8, 0),
    "_sage_qk_int8_pv_fp16_triton": (8, 0),
    "_sage_qk_int8_pv_fp8_cuda": (8, 9),
    "_sage_qk_int8_pv_fp8_cuda_sm90": (9, 0),
}


class BackendUnusable(RuntimeError):
    """The configured attention backend cannot run here; the message says why."""


def check_model(transformer, name: str, device: torch.device, dtype: torch.dtype) -> None:
    """`check` with this transformer's head shape (h3serve/runtime/fastpath.py then sets the backend)."""
    heads, head_dim = transformer.config.num_attention_heads, transformer.config.attention_head_dim
    check(name, heads, head_dim, device, dtype)
    log.info(
        "attention backend %s: usable on %s with %s (heads %d, head dim %d)",
        name,
        _describe(device),
        dtype,
        heads,
        head_dim,
    )
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        log.info(
            "fused attention kernels for %s with %s: %s",
            _sm(capability),
            dtype,
            ", ".join(kernels_for(capability, dtype)),
        )


def capability_refusal(name: str, capability: tuple[int, int], dtype: torch.dtype) -> str | None:
    """Why backend `name` has no kernel for a GPU of this compute capability and dtype; None when it has."""
    needed: tuple[int, int] | None
    if name in local_kernels.KERNELS:
        needed = local_kernels.KERNELS[name].capability
    else:
        needed = BF16_CAPABILITY.get(name) if dtype == torch.bfloat16 else None
    if needed is None or capability >= needed:
        return None
    if name in SDPA:
        return (
            f"attention backend {name!r}: PyTorch has no fused bf16 attention kernel on {_sm(capability)} (flash, "
            "memory-efficient and cuDNN attention take bf16 from sm_80), so only MATH is left, which materialises "
            'the S x S scores and runs out of memory; use attention_backend = "sage" (INT8 Q.K, FP16 P.V)'
        )
    return f"attention backend {name!r} needs compute capability {_sm(needed)} or newer; this GPU is {_sm(capability)}"


def kernels_for(capability: tuple[int, int], dtype: torch.dtype) -> list[str]:
    """The fused backends with a kernel for this capability and dtype (installed or not)."""
    names = (*SDPA[1:], *local_kernels.KERNELS, "flash", "_flash_3")
    return [name for name in names if capability_refusal(name, capability, dtype) is None]


def check(
    name: str,
    heads: int,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype,
    sequence_parallel: bool = False,
    ring: bool = False,
) -> None:
    """Raise BackendUnusable, with the reason, unless `name` runs the model's attention shape here (and
    under diffusers' context parallelism when the group splits the sequence, by ring when `ring`)."""
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _AttentionBackendRegistry,
        _check_attention_backend_requirements,
        dispatch_attention_fn,
    )

    if device.type == "cuda" and name in MATERIALISING:
        raise BackendUnusable(
            f"attention backend {name!r} materialises the S x S score matrix, which a long "
            "packed sequence cannot afford on a GPU; use a fused backend (_native_cudnn, "
            "_native_flash, flash, sage, or native, which is kept off MATH)"
        )
    if name.endswith("_hub"):
        raise BackendUnusable(
            f"attention backend {name!r} downloads its kernel at run time, which h3serve never "
            "does; install the kernel locally and use its local backend name (e.g. flash4)"
        )
    if device.type == "cuda" and (refusal := capability_refusal(name, torch.cuda.get_device_capability(device), dtype)):
        raise BackendUnusable(refusal)
    if ring and name in local_kernels.KERNELS:
        raise BackendUnusable(
            f"attention backend {name!r} runs under Ulysses but not ring attention, which needs the "
            "kernel's log-sum-exp; set ulysses_degree instead of ring_degree"
        )
    try:
        if name in local_kernels.KERNELS:  # bound to diffusers' flash_4_hub backend locally, never downloaded
            local_kernels.bind(name)
            backend = AttentionBackendName.FLASH_4_HUB
        else:
            backend = AttentionBackendName(name)
            _check_attention_backend_requirements(backend)
    except (RuntimeError, ValueError, ImportError) as exc:
        message, prefix = str(exc), f"attention backend {name!r}"  # the local kernels' reasons start with it
        raise BackendUnusable(message if message.startswith(prefix) else f"{prefix}: {message}") from exc
    if sequence_parallel and not _AttentionBackendRegistry._is_context_parallel_available(backend):
        capable = _AttentionBackendRegistry._supports_context_parallel
        usable = ", ".join(sorted(getattr(b, "value", b) for b in capable))
        raise BackendUnusable(
            f"attention backend {name!r} cannot split the sequence across ranks (diffusers "
            f"runs context parallelism only with {usable}); use one of them with world_size > 1"
        )
    q, k, v = (torch.randn(1, PROBE_TOKENS, heads, head_dim, device=device, dtype=dtype) for _ in range(3))
    try:
        with no_math_kernel(name, device, PROBE_TOKENS, limit=0):
            out = dispatch_attention_fn(q, k, v, backend=backend)
    except Exception as exc:  # the kernel's own reason is the useful part
        raise BackendUnusable(
            f"attention backend {name!r} cannot run on {_describe(device)} with {dtype} "
            f"(heads {heads}, head dim {head_dim}): {exc}"
        ) from exc
    if not torch.isfinite(out).all():
        raise BackendUnusable(f"attention backend {name!r} gave non-finite output on {_describe(device)} with {dtype}")


def no_math_kernel(name: str, device: torch.device, tokens: int, limit: int):
    """For `native` on a GPU above `limit` tokens: SDPA may use only fused kernels (else it raises)."""
    if name != "native" or device.type != "cuda" or tokens <= limit:
        return contextlib.nullcontext()
    return sdpa_kernel(FUSED)


def packed_length(text_tokens: int, spec, conditioning: dict) -> int:
    """Rows of the packed sequence: text, the conditioning latents' rows (latent frames x 2x2 patches, and
    reference audio rows) and the generated video and audio (h3serve/model/rules.py)."""
    video = sum(
        t.shape[2] * (t.shape[3] // rules.PATCH) * (t.shape[4] // rules.PATCH)
        for t in conditioning.get("condition_latents", [])
    )
    audio = sum(t.shape[0] for t in conditioning.get("audio_condition_latents", []))
    generated = rules.generated_rows(spec.height, spec.width, rules.align_num_frames(max(spec.num_frames, 1)))
    return text_tokens + video + audio + generated.total


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)}, {_sm(torch.cuda.get_device_capability(device))})"
    return str(device)


def _sm(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"
