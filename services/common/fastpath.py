"""The fast path of the DiT and the video VAE: attention kernel, regional compile, fp8 weights.

Each option is chosen by config and applied once to a loaded model, before any parallelism wraps
it. None changes the math of the released model; what each costs in accuracy is measured by
`bench/dit_step.py` and `bench/vae_decode.py` against fp32 (see BENCHMARKS.md).

- `attention = "flash4"`: FlashAttention 4 (the `flash-attn-4` package, Hopper and newer),
  installed locally and bound to diffusers' `flash_4_hub` backend, so nothing is downloaded.
  It runs as an opaque custom op, which keeps the compiled blocks whole (fullgraph).
- `attention = "cudnn_fp8"` (opt-in, it changes the numbers): cuDNN's FP8 attention with finer
  scaling around it (services/common/fp8_attention.py), bound the same way.
- `compile`: `torch.compile` of the repeated blocks (one graph, reused by every block).
- `fp8` (DiT only): dynamic rowwise W8A8 fp8 (torchao) on the linears of the transformer blocks;
  the AdaLN projections stay bf16 (they run on a handful of rows). Opt-in: it changes the numbers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.common import fp8_attention

log = logging.getLogger("h3serve.fastpath")
FLASH4 = "flash4"
LOCAL_KERNELS = (FLASH4, fp8_attention.NAME)  # installed here and bound to diffusers' flash_4_hub backend
FLAGS = ("compile", "fp8")  # in the order `describe` and the benches write them


@dataclass(frozen=True)
class FastPath:
    attention: str = "native"  # a diffusers backend name, or one of LOCAL_KERNELS
    compile: bool = False
    fp8: bool = False

    def describe(self) -> str:
        return "+".join([self.attention, *(flag for flag in FLAGS if getattr(self, flag))])

    @property
    def lossy(self) -> bool:
        """Computes different numbers from the released bf16 model (fp8 weights or fp8 attention)."""
        return self.fp8 or self.attention == fp8_attention.NAME


def apply(model: torch.nn.Module, fast: FastPath) -> None:
    """Set the attention kernel, quantise, then compile (compile must see the final modules)."""
    set_attention(model, fast.attention)
    if fast.fp8:
        quantize_fp8(model)
    if fast.compile:
        model.compile_repeated_blocks(fullgraph=True)
    log.info("%s fast path: %s", type(model).__name__, fast.describe())


def set_attention(model: torch.nn.Module, backend: str) -> None:
    if backend not in LOCAL_KERNELS:
        model.set_attention_backend(backend)
        return
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    bind_local_kernel(backend)
    # diffusers' own setter insists on the `kernels` hub client for this backend; the kernel is
    # already bound, so set the processors directly.
    name = AttentionBackendName.FLASH_4_HUB
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_attention_backend"):
            processor._attention_backend = name
    _AttentionBackendRegistry.set_active_backend(name)


def bind_local_kernel(name: str) -> None:
    """Point diffusers' flash_4_hub backend, its hook for a kernel supplied from outside, at the local
    kernel `name`, after checking that it can run here. The hook is one per process: binding another
    kernel moves every model on that backend in this process to it (the benches do so on purpose)."""
    from diffusers.models.attention_dispatch import _HUB_KERNELS_REGISTRY, AttentionBackendName

    check, kernel = {FLASH4: (_check_flash4, _flash4_kernel),
                     fp8_attention.NAME: (fp8_attention.check_available, fp8_attention.attention)}[name]
    check()
    slot = _HUB_KERNELS_REGISTRY[AttentionBackendName.FLASH_4_HUB]
    if slot.kernel_fn not in (None, kernel):
        log.warning("attention backend %s replaces %s in this process", name, getattr(slot.kernel_fn, "__name__", "?"))
    slot.kernel_fn = kernel


def _check_flash4() -> None:
    try:
        import flash_attn.cute  # noqa: F401  (the flash-attn-4 package)
    except ImportError as exc:
        raise RuntimeError("attention backend 'flash4' needs the flash-attn-4 package (and its CUTLASS DSL "
                           f"libraries) installed: {exc}") from exc
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise RuntimeError("attention backend 'flash4' needs an NVIDIA GPU of compute capability 9.0 or newer")


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
