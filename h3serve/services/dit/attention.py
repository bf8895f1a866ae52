"""The DiT's attention backend: explicit, checked on this device and dtype at start, never MATH when long.

The field notes' biggest lesson: PyTorch SDPA silently falls back to the MATH kernel, which
materialises the S x S score matrix and runs out of memory on a long packed sequence. So the
backend is set by name (diffusers checks the package), probed once with the model's head shape
and dtype on the rank's device (a kernel that cannot run fails the start with its reason), and
`native` on a GPU runs with MATH disabled above `max_math_tokens`.
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


class BackendUnusable(RuntimeError):
    """The configured attention backend cannot run here; the message says why."""


def check_model(transformer, name: str, device: torch.device, dtype: torch.dtype) -> None:
    """`check` with this transformer's head shape (h3serve/runtime/fastpath.py then sets the backend)."""
    heads, head_dim = transformer.config.num_attention_heads, transformer.config.attention_head_dim
    check(name, heads, head_dim, device, dtype)
    log.info("attention backend %s: usable on %s with %s (heads %d, head dim %d)", name, _describe(device), dtype,
             heads, head_dim)


def check(name: str, heads: int, head_dim: int, device: torch.device, dtype: torch.dtype,
          sequence_parallel: bool = False, ring: bool = False) -> None:
    """Raise BackendUnusable, with the reason, unless `name` runs the model's attention shape here (and
    under diffusers' context parallelism when the group splits the sequence, by ring when `ring`)."""
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _AttentionBackendRegistry,
        _check_attention_backend_requirements,
        dispatch_attention_fn,
    )

    if device.type == "cuda" and name in MATERIALISING:
        raise BackendUnusable(f"attention backend {name!r} materialises the S x S score matrix, which a long "
                              "packed sequence cannot afford on a GPU; use a fused backend (_native_cudnn, "
                              "_native_flash, flash, sage, or native, which is kept off MATH)")
    if name.endswith("_hub"):
        raise BackendUnusable(f"attention backend {name!r} downloads its kernel at run time, which h3serve never "
                              "does; install the kernel locally and use its local backend name (e.g. flash4)")
    if ring and name in local_kernels.KERNELS:
        raise BackendUnusable(f"attention backend {name!r} runs under Ulysses but not ring attention, which needs the "
                              "kernel's log-sum-exp; set ulysses_degree instead of ring_degree")
    try:
        if name in local_kernels.KERNELS:  # bound to diffusers' flash_4_hub backend locally, never downloaded
            local_kernels.bind(name)
            backend = AttentionBackendName.FLASH_4_HUB
        else:
            backend = AttentionBackendName(name)
            _check_attention_backend_requirements(backend)
    except (RuntimeError, ValueError, ImportError) as exc:
        raise BackendUnusable(f"attention backend {name!r}: {exc}") from exc
    if sequence_parallel and not _AttentionBackendRegistry._is_context_parallel_available(backend):
        capable = _AttentionBackendRegistry._supports_context_parallel
        usable = ", ".join(sorted(getattr(b, "value", b) for b in capable))
        raise BackendUnusable(f"attention backend {name!r} cannot split the sequence across ranks (diffusers "
                              f"runs context parallelism only with {usable}); use one of them with world_size > 1")
    q, k, v = (torch.randn(1, PROBE_TOKENS, heads, head_dim, device=device, dtype=dtype) for _ in range(3))
    try:
        with no_math_kernel(name, device, PROBE_TOKENS, limit=0):
            out = dispatch_attention_fn(q, k, v, backend=backend)
    except Exception as exc:  # the kernel's own reason is the useful part
        raise BackendUnusable(f"attention backend {name!r} cannot run on {_describe(device)} with {dtype} "
                              f"(heads {heads}, head dim {head_dim}): {exc}") from exc
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
    video = sum(t.shape[2] * (t.shape[3] // rules.PATCH) * (t.shape[4] // rules.PATCH)
                for t in conditioning.get("condition_latents", []))
    audio = sum(t.shape[0] for t in conditioning.get("audio_condition_latents", []))
    generated = rules.generated_rows(spec.height, spec.width, rules.align_num_frames(max(spec.num_frames, 1)))
    return text_tokens + video + audio + generated.total


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
