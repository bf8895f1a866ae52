"""The fast path of the DiT and the video VAE: attention kernel, regional compile, fp8 weights.

Each option is chosen by config and applied once to a loaded model, before any parallelism wraps
it. None changes the math of the released model; what each costs in accuracy is measured by
`bench/dit_step.py` and `bench/vae_decode.py` against fp32 (see BENCHMARKS.md).

- `attention = "flash4"`: FlashAttention 4, or `"cudnn_fp8"` (opt-in, it changes the numbers): cuDNN's
  FP8 attention; both installed locally and bound to diffusers' `flash_4_hub` backend, so nothing is
  downloaded (h3serve/runtime/kernels/local.py).
- `compile`: `torch.compile` of each repeated block's own forward (one graph per block kind, reused by every
  block; the hooks diffusers wraps around blocks stay outside it). torch's default compiles a graph for the first
  sizes it meets and a second, dynamic one when a size changes; `dynamic` compiles the dynamic one from the first
  call (every canvas, frame count and prompt length runs it); `tune` adds Inductor's coordinate-descent tuning.
- `fp8`: dynamic rowwise W8A8 fp8 (torchao) on the linears of the transformer blocks (the DiT's, and the video
  VAE's ViT decoder's); the AdaLN projections (they run on a handful of rows) and LoRA adapters' factors stay bf16.
  Opt-in: it changes the numbers.
- `linears = "fp16_scaled"` (`[dit] linear_precision`): the DiT's linears on fp16 tensor cores without overflow,
  the residual stream in fp32 (h3serve/runtime/fp16_linears.py); with `weights = "int8"` the block linears held in
  int8 and widened to fp16 as each runs (h3serve/runtime/int8_weights.py). For sm_75; it changes the numbers.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from h3serve.runtime import fp16_linears, pinned
from h3serve.runtime.kernels import fp8_attention
from h3serve.runtime.kernels import local as local_kernels
from h3serve.runtime.quantised_store import Layout

if TYPE_CHECKING:
    from diffusers.models.modeling_utils import ModelMixin

log = logging.getLogger("h3serve.fastpath")
FLAGS = ("compile", "dynamic", "tune", "fp8")  # in the order `describe` and the benches write them
SPLIT_RECOMPILE_LIMIT = 64  # torch's recompile limit for blocks compiled around a sequence split (`apply`)
NOISE_LEVEL_ROWS = "temb"  # the block argument with one row per distinct noise level (`_rows_unbacked`)
EAGER_FORWARD = "_h3serve_eager_forward"  # a compiled block's own forward, kept for a recompile
ZERO_ROW_FLOOR = 1e-12  # fp8's smallest row maximum for a rowwise scale, where rows of zeros reach it (`quantize_fp8`)


@dataclass(frozen=True)
class FastPath:
    attention: str = "native"  # a diffusers backend name, or one of local_kernels.KERNELS
    compile: bool = False
    dynamic: bool = False  # with compile: symbolic sizes from the first call
    tune: bool = False  # with compile: Inductor's coordinate-descent tuning of every kernel
    fp8: bool = False
    linears: str = "bf16"  # one of fp16_linears.LINEAR_PRECISIONS
    weights: str = "bf16"  # one of fp16_linears.WEIGHT_FORMATS

    def __post_init__(self) -> None:
        for flag, key in (("dynamic", "compile_dynamic"), ("tune", "compile_tuning")):
            if getattr(self, flag) and not self.compile:
                raise ValueError(f"{key} needs compile = true (it says how the blocks are compiled)")

    @classmethod
    def of(cls, config) -> FastPath:
        """The fast path a model service's config selects (h3serve/common/config/: `attention_backend`,
        `compile`, `compile_dynamic`, `fp8`); fp8 quantises bf16 weights, so it needs `dtype = "bfloat16"`."""
        if config.fp8 and config.dtype != "bfloat16":
            raise ValueError(f'fp8 needs dtype = "bfloat16" (the weights it quantises), got {config.dtype!r}')
        return cls(
            attention=config.attention_backend,
            compile=config.compile,
            dynamic=config.compile and config.compile_dynamic,
            tune=config.compile_tuning,
            fp8=config.fp8,
            linears=getattr(config, "linear_precision", "bf16"),  # the DiT's keys (h3serve/common/config/)
            weights=getattr(config, "weights", "bf16"),
        )

    def describe(self) -> str:
        linears = [] if self.linears == "bf16" else [self.linears + ("+int8" if self.weights == "int8" else "")]
        return "+".join([self.attention, *(flag for flag in FLAGS if getattr(self, flag)), *linears])

    @property
    def lossy(self) -> bool:
        """Computes different numbers from the released bf16 model (fp8 weights or fp8 attention)."""
        return self.fp8 or self.attention == fp8_attention.NAME or self.linears != "bf16"


def apply(model: ModelMixin, fast: FastPath, sequence_split: bool = False) -> None:
    """Set the attention kernel, quantise, then compile (compile must see the final modules).

    With the sequence split across ranks (`sequence_split`), diffusers' Ulysses/ring all-to-alls for
    sequences of any length exchange their sizes first, which torch.compile cannot trace: each block is
    then compiled around them (graph breaks) instead of as one graph.
    """
    set_attention(model, fast.attention)
    convert_linears(model, fast)
    if fast.fp8:
        quantize_fp8(model)
    if fast.compile:
        compile_blocks(model, fast, sequence_split)
    log.info("%s fast path: %s", type(model).__name__, fast.describe())
    if fast.linears != "bf16":
        log.info("%s: %s", type(model).__name__, fp16_linears.describe(fast.linears, fast.weights))


def convert_linears(model: torch.nn.Module, fast: FastPath) -> dict[str, fp16_linears.SourceParam]:
    """`fp16_scaled` linears (and int8 weights) for the DiT, on a loaded model or its meta-device skeleton; the
    parameters whose dtype changed (a skeleton's are filled through fp16_linears.ConvertedRows). Idempotent."""
    if fast.linears == "bf16":
        return {}
    return fp16_linears.convert(model, torch.bfloat16, int8=fast.weights == "int8")


def compile_blocks(model: ModelMixin, fast: FastPath, sequence_split: bool = False) -> None:
    # past torch's recompile limit a block would run eager without a word: fail the request loudly instead
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    if sequence_split:
        # A split group compiles a block per forward variant and per way its ranks' chunks of the packed sequence
        # differ in size (2 gloo ranks: 2 prompt lengths, tests/dist_checks.py); more ranks have more ways.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, SPLIT_RECOMPILE_LIMIT)
    # process-wide, like every Inductor setting; torchao's fp8 would turn it on as a side effect (not asked for here)
    torch._inductor.config.coordinate_descent_tuning = fast.tune
    # dynamic=None is torch's default: sizes specialised first, made symbolic when they change (a recompile)
    fullgraph, dynamic = not sequence_split, True if fast.dynamic else None
    for block in model.modules():
        if type(block).__name__ in model._repeated_blocks:
            first = EAGER_FORWARD not in vars(block)
            eager = vars(block).setdefault(EAGER_FORWARD, block.forward)  # a recompile starts from it again
            parameters = list(inspect.signature(eager).parameters)
            if first and NOISE_LEVEL_ROWS in parameters:
                block.register_forward_pre_hook(
                    functools.partial(_rows_unbacked, parameters.index(NOISE_LEVEL_ROWS)), with_kwargs=True
                )
            # The block's own forward, not the whole call `block.compile()` would compile: the hooks diffusers wraps
            # around a block then run eagerly outside its graph (group offload's copies, which compile refuses to
            # trace, and the sequence split's, whose shared wrapper made every block one code object to recompile).
            block.forward = torch.compile(eager, fullgraph=fullgraph, dynamic=dynamic)


def _rows_unbacked(position: int, _block, args: tuple, kwargs: dict) -> None:
    """A block's `temb` has a row per distinct noise level: 1 at a request's first step (video and audio start at the
    same level), 2 after it. torch specialises a size of 1, so each block compiled twice; an unbacked size is never
    specialised, so one graph serves both (tests/test_fastpath.py counts the graphs)."""
    temb = kwargs[NOISE_LEVEL_ROWS] if NOISE_LEVEL_ROWS in kwargs else args[position]
    torch._dynamo.decorators.mark_unbacked(temb, 0)


def set_attention(model: ModelMixin, backend: str) -> None:
    if backend in local_kernels.KERNELS:
        local_kernels.bind(backend)
        local_kernels.use(model)
    else:
        model.set_attention_backend(backend)


# The transformer's fp8 partitions in the quantised store (`[dit] fp8_cache_dir`): a file per block
FP8_LAYOUT = Layout(
    kind="fp8",
    blocks="transformer_blocks",
    recipe="torchao Float8DynamicActivationFloat8WeightConfig PerRow on fastpath.fp8_target, a file per block, v2",
)


def quantize_fp8(model: torch.nn.Module, prefix: str = "") -> None:
    """fp8 the block linears of a MiniMax-H3 transformer (its `transformer_blocks.*`), or of a video VAE's ViT decoder
    (named as the transformer's are), on the device its weights are on; `prefix` is the name of `model` in the whole
    transformer when it is a part of it (one block: quantised_store.build)."""
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    except ImportError as exc:
        raise RuntimeError(f"fp8 needs the torchao package: {exc}") from exc

    floor = {}
    decoder = getattr(model, "decoder", None)
    if isinstance(decoder, torch.nn.Module):  # the video VAE
        # Its decoder appends an all-zero token to every tile, which the first block's norm keeps at zero: that row's
        # scale would be 0 and its fp8 values 0/0, NaN in every frame. A floor under any real row's largest value
        # quantises it to zeros and leaves every other row's scale as it was.
        model, floor = decoder, {"activation_value_lb": ZERO_ROW_FLOOR}
    # set_inductor_config: torchao would turn on Inductor's coordinate-descent tuning process-wide (`compile_tuning`)
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False, **floor)
    quantize_(model, config, filter_fn=lambda module, name: fp8_target(module, prefix + name))


def fp8_target(module: torch.nn.Module, name: str) -> bool:
    """The block linears fp8 quantises. A LoRA adapter's own linears (peft's `<layer>.lora_A.<adapter>`) stay in
    their dtype: they are small, and adapters switch by writing them; the layer they adapt (`<layer>.base_layer`)
    is quantised as any other. A linear already fp8 (assigned from the fp8 store, h3serve/runtime/quantised_store.py) is
    left as it is."""
    return (
        isinstance(module, torch.nn.Linear)
        and name.startswith("transformer_blocks.")
        and ".adaln_proj." not in name
        and ".lora_" not in name
        and not pinned.parts(module.weight)
    )
