"""The fast path of the DiT and the video VAE: attention kernel, regional compile, fp8 weights.

Each option is chosen by config and applied once to a loaded model, before any parallelism wraps
it. None changes the math of the released model; what each costs in accuracy is measured by
`bench/dit_step.py` and `bench/vae_decode.py` against fp32 (see BENCHMARKS.md).

- `attention = "flash4"`: FlashAttention 4, or `"cudnn_fp8"` (opt-in, it changes the numbers): cuDNN's
  FP8 attention; both installed locally and bound to diffusers' `flash_4_hub` backend, so nothing is
  downloaded (h3serve/runtime/kernels/local.py).
- `compile`: `torch.compile` of the repeated blocks (one graph, reused by every block). torch's default
  compiles a graph for the first sizes it meets and a second, dynamic one when a size changes; `dynamic`
  compiles the dynamic one from the first call (one compile instead of two per forward variant, and every
  canvas, frame count and prompt length runs it).
- `fp8` (DiT only): dynamic rowwise W8A8 fp8 (torchao) on the linears of the transformer blocks;
  the AdaLN projections (they run on a handful of rows) and LoRA adapters' factors stay bf16.
  Opt-in: it changes the numbers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from h3serve.runtime.kernels import fp8_attention
from h3serve.runtime.kernels import local as local_kernels

log = logging.getLogger("h3serve.fastpath")
FLAGS = ("compile", "dynamic", "fp8")  # in the order `describe` and the benches write them
SPLIT_RECOMPILE_LIMIT = 64  # torch's recompile limit for blocks compiled around a sequence split (`apply`)


@dataclass(frozen=True)
class FastPath:
    attention: str = "native"  # a diffusers backend name, or one of local_kernels.KERNELS
    compile: bool = False
    dynamic: bool = False  # with compile: symbolic sizes from the first call
    fp8: bool = False

    def __post_init__(self) -> None:
        if self.dynamic and not self.compile:
            raise ValueError("compile_dynamic needs compile = true (it says how the blocks are compiled)")

    @classmethod
    def of(cls, config) -> FastPath:
        """The fast path a model service's config selects (h3serve/common/config.py: `attention_backend`,
        `compile`, `compile_dynamic`, `fp8`); fp8 quantises bf16 weights, so it needs `dtype = "bfloat16"`."""
        if config.fp8 and config.dtype != "bfloat16":
            raise ValueError(f"fp8 needs dtype = \"bfloat16\" (the weights it quantises), got {config.dtype!r}")
        return cls(attention=config.attention_backend, compile=config.compile,
                   dynamic=config.compile and config.compile_dynamic, fp8=config.fp8)

    def describe(self) -> str:
        return "+".join([self.attention, *(flag for flag in FLAGS if getattr(self, flag))])

    @property
    def lossy(self) -> bool:
        """Computes different numbers from the released bf16 model (fp8 weights or fp8 attention)."""
        return self.fp8 or self.attention == fp8_attention.NAME


def apply(model: torch.nn.Module, fast: FastPath, sequence_split: bool = False) -> None:
    """Set the attention kernel, quantise, then compile (compile must see the final modules).

    With the sequence split across ranks (`sequence_split`), diffusers' Ulysses/ring all-to-alls for
    sequences of any length exchange their sizes first, which torch.compile cannot trace: each block is
    then compiled around them (graph breaks) instead of as one graph.
    """
    set_attention(model, fast.attention)
    if fast.fp8:
        quantize_fp8(model)
    if fast.compile:
        compile_blocks(model, fast, sequence_split)
    log.info("%s fast path: %s", type(model).__name__, fast.describe())


def compile_blocks(model: torch.nn.Module, fast: FastPath, sequence_split: bool = False) -> None:
    # past torch's recompile limit a block would run eager without a word: fail the request loudly instead
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    if sequence_split:
        # Compiled around the all-to-alls, a block's entry point is diffusers' hook wrapper (`new_forward`), one
        # code object for every hooked module: each module kind, forward variant and sequence length residue
        # takes a cache entry (2 gloo ranks: 41 graphs until every prompt length was covered), past torch's 8.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, SPLIT_RECOMPILE_LIMIT)
    # dynamic=None is torch's default: sizes specialised first, made symbolic when they change (a recompile)
    model.compile_repeated_blocks(fullgraph=not sequence_split, dynamic=True if fast.dynamic else None)


def set_attention(model: torch.nn.Module, backend: str) -> None:
    if backend in local_kernels.KERNELS:
        local_kernels.bind(backend)
        local_kernels.use(model)
    else:
        model.set_attention_backend(backend)


def quantize_fp8(transformer: torch.nn.Module) -> None:
    """fp8 the block linears of a MiniMax-H3 transformer (its `transformer_blocks.*`)."""
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    except ImportError as exc:
        raise RuntimeError(f"fp8 needs the torchao package: {exc}") from exc

    quantize_(transformer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()), filter_fn=fp8_target)


def fp8_target(module: torch.nn.Module, name: str) -> bool:
    """The block linears fp8 quantises. A LoRA adapter's own linears (peft's `<layer>.lora_A.<adapter>`) stay in
    their dtype: they are small, and adapters switch by writing them; the layer they adapt (`<layer>.base_layer`)
    is quantised as any other."""
    return (isinstance(module, torch.nn.Linear) and name.startswith("transformer_blocks.")
            and ".adaln_proj." not in name and ".lora_" not in name)
