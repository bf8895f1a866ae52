"""The fast path of the DiT and the video VAE: attention kernel, regional compile, fp8 weights.

Each option is chosen by config and applied once to a loaded model, before any parallelism wraps
it. None changes the math of the released model; what each costs in accuracy is measured by
`bench/dit_step.py` and `bench/vae_decode.py` against fp32 (see BENCHMARKS.md).

- `attention = "flash4"`: FlashAttention 4 (the `flash-attn-4` package, Hopper and newer),
  installed locally and bound to diffusers' `flash_4_hub` backend, so nothing is downloaded.
  It runs as an opaque custom op, which keeps the compiled blocks whole (fullgraph).
- `compile`: `torch.compile` of the repeated blocks (one graph, reused by every block).
- `fp8` (DiT only): dynamic rowwise W8A8 fp8 (torchao) on the linears of the transformer blocks;
  the AdaLN projections stay bf16 (they run on a handful of rows). Opt-in: it changes the numbers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("h3serve.fastpath")
FLASH4 = "flash4"


@dataclass(frozen=True)
class FastPath:
    attention: str = "native"  # a diffusers backend name, or "flash4"
    compile: bool = False
    fp8: bool = False

    def describe(self) -> str:
        extras = [name for name, on in (("compile", self.compile), ("fp8", self.fp8)) if on]
        return "+".join([self.attention, *extras])


def apply(model: torch.nn.Module, fast: FastPath) -> None:
    """Set the attention kernel, quantise, then compile (compile must see the final modules)."""
    set_attention(model, fast.attention)
    if fast.fp8:
        quantize_fp8(model)
    if fast.compile:
        model.compile_repeated_blocks(fullgraph=True)
    log.info("%s fast path: %s", type(model).__name__, fast.describe())


def set_attention(model: torch.nn.Module, backend: str) -> None:
    if backend != FLASH4:
        model.set_attention_backend(backend)
        return
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    bind_flash4()
    # diffusers' own setter insists on the `kernels` hub client for this backend; the kernel is
    # already bound, so set the processors directly.
    name = AttentionBackendName.FLASH_4_HUB
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_attention_backend"):
            processor._attention_backend = name
    _AttentionBackendRegistry.set_active_backend(name)


def bind_flash4() -> None:
    """Point diffusers' flash_4_hub backend at the locally installed FlashAttention 4."""
    try:
        import flash_attn.cute  # noqa: F401  (the flash-attn-4 package)
    except ImportError as exc:
        raise RuntimeError("attention backend 'flash4' needs the flash-attn-4 package (and its CUTLASS DSL "
                           f"libraries) installed: {exc}") from exc
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise RuntimeError("attention backend 'flash4' needs an NVIDIA GPU of compute capability 9.0 or newer")
    from diffusers.models.attention_dispatch import _HUB_KERNELS_REGISTRY, AttentionBackendName

    _HUB_KERNELS_REGISTRY[AttentionBackendName.FLASH_4_HUB].kernel_fn = _flash4_kernel


def _flash4_kernel(q, k, v, softmax_scale=None, causal=False):
    if causal:
        raise ValueError("MiniMax-H3 attention is never causal")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return torch.ops.h3serve.flash4(q, k, v, scale)


@torch.library.custom_op("h3serve::flash4", mutates_args=())
def flash4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """(batch, rows, heads, head_dim) attention without a mask, through FlashAttention 4."""
    from flash_attn.cute import flash_attn_func

    out = flash_attn_func(q, k, v, softmax_scale=scale, causal=False)
    return out[0] if isinstance(out, tuple) else out


@flash4.register_fake
def _(q, k, v, scale):
    return torch.empty_like(q)


def quantize_fp8(transformer: torch.nn.Module) -> None:
    """fp8 the block linears of a MiniMax-H3 transformer (its `transformer_blocks.*`)."""
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    except ImportError as exc:
        raise RuntimeError(f"fp8 needs the torchao package: {exc}") from exc

    def block_linear(module: torch.nn.Module, name: str) -> bool:
        return (isinstance(module, torch.nn.Linear) and name.startswith("transformer_blocks.")
                and ".adaln_proj." not in name)

    quantize_(transformer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()), filter_fn=block_linear)
