"""Where the text encoder (Qwen3-VL) lives: quantized, spread over GPUs, or offloaded to host memory.

Qwen3-VL-32B is ~62 GiB in bf16, more than one small card holds. `[encoder]` chooses (h3serve/common/config/,
`EncoderConfig`):

- `quantize = "int8"`: torchao weight-only int8 (`Int8WeightOnlyConfig`: one scale per output row, activations
  stay in `dtype`) on the **decoder layers' linears** (`model.language_model.layers.*`: q/k/v/o and the MLP), which
  hold ~96 % of the 32B weights. Left as they are:
  - the token embedding (a lookup, not a matmul; quantizing it saves 1.5 GiB and adds error to every row),
  - `lm_head` (never run: the pipeline reads `hidden_states[50]` off `text_encoder.model`),
  - the vision tower (0.6 B parameters, ~2 % of the weights: little to save, and its error would reach every
    vision token of fl2va and ref2va), and every norm.
  Works on the CPU too (torchao dequantizes in its matmul). Needs torchao (a dependency).
- `quantize = "nf4"`: bitsandbytes 4-bit NF4 (double-quantized statistics, compute in `dtype`) on the same
  linears. CUDA only: refused at start on the CPU. bitsandbytes is the `gpu` extra (`pip install 'h3serve[model,gpu]'`)
  and is imported only when nf4 is configured.
- `spread = true`: accelerate's balanced device map over every visible GPU (`infer_auto_device_map` with
  `get_balanced_memory`; Qwen3-VL's `_no_split_modules` keep each decoder layer and vision block whole), then
  `dispatch_model`. Refused at start unless the process sees at least 2 CUDA devices: on one device it would do
  nothing, and a setting that does nothing is refused rather than ignored (field notes); set `spread = false` to
  load the encoder whole on one GPU. Refused too if the model does not fit the GPUs' free memory (nothing is
  offloaded to the CPU silently). With a quantization and a model directory (or `random:full`), the map is made on
  the meta-device skeleton and each decoder layer is filled from the safetensors files on its GPU and quantized
  there before the next (`build_spread`): the 48.9 GiB of bf16 never pass through host memory (the 4 x 22 GB box's
  64 GB host, docs/turing-memory.md). The tiny preset is spread whole, then quantized in place on its GPUs.
- `cpu_offload = true`: the weights stay in pinned host memory and each decoder layer and vision block is copied
  to `device` on a side CUDA stream while the one before it runs (h3serve/runtime/offload.py, as the DiT's
  `offload = "group"`); the embedding, the norms and the vision tower's patch and position embeddings and merger
  are copied whole, without the stream, when their module runs. Every request not in the embedding cache still
  moves the whole model over PCIe: 2.2-2.6 s for a 256-token prompt in the 32 GB profile on one H200 (docs/deploy/
  small-gpus.md), where accelerate's `cpu_offload`, which this replaced (synchronous copies from pageable memory),
  took 8.8-9.0 s. Needs a CUDA `device` (on the CPU the weights are in host memory
  already: refused as doing nothing). With `quantize = "int8"` the int8 weights are what host memory holds (25.7
  GiB for the released encoder instead of 48.9: what makes the 32 GB profile fit a 64 GB host); each decoder
  layer is quantized on the GPU and brought back (`quantize_through`). nf4 cannot be streamed: refused.

**int8 cache.** `int8_cache_dir` (with int8 and cpu_offload or spread) keeps the int8 encoder in the quantised
store (h3serve/runtime/quantised_store.py, `INT8_LAYOUT`: a file per decoder layer): the first start quantizes into
it layer by layer on the GPU, every start then assigns the files, memory-mapped, and places the int8 model from host
memory (pinned for cpu_offload, dispatched for spread), so a restart neither reads the bf16 weights nor quantizes.
The quantization took 25.5 s of the one-H100 profile's 76.9 s start from filled caches (docs/deploy/
single-h100.md). Embeddings are those of the encoder quantized without the store (tests/test_encoder_int8_store.py).

Whenever one of these is set on a CUDA device the components are loaded to the CPU first and placed from there, so
the whole bf16 model never has to fit one GPU (int8/nf4: each linear is moved to the GPU and quantized there, one
at a time). Only quantization changes the numbers: offload gave bit-identical embeddings on the CPU and, in bf16
against the resident encoder, on one H200 (tests/test_encoder_placement.py), and spread runs the same kernels, only
on other GPUs.

The `gpu` tests of tests/test_encoder_placement.py passed on one H200 for int8 and cpu_offload on CUDA; not verified
on a GPU yet: the nf4 path (bitsandbytes was not installed there) and spread (it needs 2 GPUs).

**Variant.** `variant(config)` names the numbers the encoder produces: "int8" or "nf4" when quantized, else the
dtype ("bf16", "fp32", "fp16"). It is part of every embedding-cache key (h3serve/services/encoder/cache.py), so a
quantized encoder never serves bf16 embeddings from a shared cache, nor the reverse; `Info` reports it in
`ModelInfo.dtype` ("bfloat16 (int8 weights)") and the placement in `ModelInfo.device`.

**The documented int8 error** (prompt_embeds of the int8 encoder against the same encoder unquantized; relative L2
= ||q - ref|| / ||ref||; prompt "a quiet harbour at dawn, gulls circling over fishing boats while a bell rings in
the distance", t2va; measured on the CPU, torch 2.14.1, torchao 0.18.0):

| encoder | compute | max abs | max abs / max abs(ref) | relative L2 |
|---|---|---|---|---|
| tiny preset (hidden 32, 51 layers), 93 tokens | fp32 | 2.50e-3 | 0.9 % | 1.00e-2 |
| random Qwen3-VL: hidden 1024, MLP 2048, 16 heads (4 kv), 51 layers, 455 M params | fp32 | 4.64e-1 | 3.4 % | 4.06e-2 |
| same | bf16 (against bf16) | 6.56e-1 | 4.7 % | 4.90e-2 |
| same, unquantized bf16 against fp32, for scale | bf16 | 4.03e-1 | 2.9 % | 1.96e-2 |

Documented bound (`INT8_BOUND`): max abs <= 10 % of the reference's largest magnitude and relative L2 <= 0.1.
Random weights are not trained ones (no outlier channels); the released 32B has not been measured here.
Reproduce (2 shared CPU cores: seconds; ~2-5 min): `.venv/bin/python -m bench.encoder_int8` (tiny) and
`... measure 1024 2048 51`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from h3serve.common.config import EncoderConfig
from h3serve.runtime import pinned
from h3serve.runtime.offload import stream_from_host
from h3serve.runtime.quantised_store import Build, Layout, QuantisedStore

if TYPE_CHECKING:
    from transformers import Qwen3VLForConditionalGeneration

log = logging.getLogger("h3serve.encoder")

DECODER_LAYERS = "model.language_model.layers."  # Qwen3VLForConditionalGeneration's text decoder layers
SHORT_DTYPES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
# The int8 layers in the quantised store (`[encoder] int8_cache_dir`): a file per decoder layer
INT8_LAYOUT = Layout(
    kind="int8",
    blocks=DECODER_LAYERS.rstrip("."),
    recipe="torchao Int8WeightOnlyConfig on every linear of a decoder layer (quantize_layer), a file per layer, v1",
)
SPREAD_HEADROOM = 0.9  # of each GPU's free memory (or memory_limit_gib) the spread weights may take
# Qwen3VLModel's children diffusers' block-level offload recurses into (it groups the ModuleLists of each)
OFFLOAD_BLOCK_MODULES = ["language_model", "visual"]


@dataclass(frozen=True)
class ErrorBound:
    max_abs_fraction: float  # max |q - ref| over max |ref|
    rel_l2: float  # ||q - ref|| / ||ref||

    def holds(self, quantized: torch.Tensor, reference: torch.Tensor) -> bool:
        max_abs, rel = embedding_error(quantized, reference)
        return max_abs <= self.max_abs_fraction * reference.float().abs().max().item() and rel <= self.rel_l2


INT8_BOUND = ErrorBound(max_abs_fraction=0.10, rel_l2=0.10)


def embedding_error(quantized: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(max abs, relative L2) of `quantized` against `reference`, in fp32."""
    diff = quantized.float() - reference.float()
    return diff.abs().max().item(), (diff.norm() / reference.float().norm()).item()


def _settings(config: EncoderConfig) -> tuple[str, bool, bool]:
    """(quantize, spread, cpu_offload)."""
    return config.quantize, config.spread, config.cpu_offload


def variant(config: EncoderConfig) -> str:
    """The numbers this encoder computes: "int8" / "nf4" when quantized, else its dtype ("bf16", "fp32")."""
    quantize, _, _ = _settings(config)
    return quantize if quantize != "none" else SHORT_DTYPES.get(config.dtype, config.dtype)


def staged_on_cpu(config: EncoderConfig) -> bool:
    """Load to the CPU first and place from there (so the bf16 model never has to fit one GPU)."""
    quantize, spread, offload = _settings(config)
    return torch.device(config.device).type != "cpu" and (quantize != "none" or spread or offload)


def check(config: EncoderConfig) -> None:
    """Refuse at start, before any weight is loaded, what placement cannot do here (ValueError, one line)."""
    quantize, spread, offload = _settings(config)
    cuda = torch.device(config.device).type == "cuda"
    if offload:
        if not cuda:
            raise ValueError(
                f"cpu_offload = true keeps the weights in host memory and runs each layer on the GPU: "
                f'it needs device = "cuda"; on {config.device!r} the weights are in host memory already'
            )
        if quantize == "nf4":
            raise ValueError(
                'cpu_offload = true and quantize = "nf4" do not go together (bitsandbytes\' 4-bit '
                'weights cannot be kept in host memory and streamed); use quantize = "int8" with it'
            )
    if config.int8_cache_dir and not config.model_dir:
        raise ValueError(
            "int8_cache_dir keeps an encoder built from [model] dir (or random:full) layer by layer: the tiny "
            'preset is built whole in a moment, there is nothing to save (set int8_cache_dir = "")'
        )
    if quantize == "int8" and importlib.util.find_spec("torchao") is None:
        raise ValueError('quantize = "int8" needs the torchao package (pip install torchao)')
    if quantize == "nf4":
        if not cuda or not torch.cuda.is_available():
            raise ValueError(
                f'quantize = "nf4" needs a CUDA device (bitsandbytes\' 4-bit kernels); this encoder '
                f'runs on {config.device!r}{_no_cuda()}: use quantize = "int8" on the CPU'
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(
                "quantize = \"nf4\" needs the bitsandbytes package (the gpu extra: pip install 'h3serve[model,gpu]')"
            )
    if spread:
        visible = torch.cuda.device_count() if cuda and torch.cuda.is_available() else 0
        if visible < 2:
            raise ValueError(
                f"spread = true puts the text encoder's decoder layers on several GPUs: it needs device "
                f'= "cuda" and at least 2 visible CUDA devices; this process has device = '
                f"{config.device!r} and sees {visible} (gpus = {config.gpus!r}). With one GPU set "
                f"spread = false (whole on it), quantize or cpu_offload"
            )


def _no_cuda() -> str:
    return "" if torch.cuda.is_available() else " (no CUDA device is visible)"


def load(config: EncoderConfig, names: list[str]):
    """load_model_service, then place the text encoder; returns (components, ModelInfo)."""
    from h3serve.runtime.service import load_model_service

    staged = staged_on_cpu(config)
    weights = layer_weights(config)
    if weights is None:
        components, model = load_model_service("encoder", names, config.replace(device="cpu") if staged else config)
    else:  # the text encoder filled layer by layer below (from the int8 store, or by place())
        others = [name for name in names if name != "text_encoder"]
        components, model = load_model_service("encoder", others, config.replace(device="cpu"))
        model.components.append("text_encoder")
    if staged:  # load_model_service capped the allocator of the device it loaded to, the CPU: cap the GPU(s) now
        from h3serve.runtime import memory

        try:
            memory.cap(config, config.device)
        except memory.MemoryLimitError as exc:
            raise ValueError(f"memory_limit_gib: {exc}") from None
    stored = None  # the int8 encoder assigned from the store
    if weights is not None:  # filled layer by layer: from the int8 store, else by place() below
        store = int8_store(config, model.model_revision)
        stored = from_store(store, weights, config) if store else None
        dtype = TORCH_DTYPES[config.dtype]
        components["text_encoder"] = stored if stored is not None else skeleton(weights, dtype)
    quantized = stored is not None
    model.device = place(components["text_encoder"], config, None if quantized else weights, quantized=quantized)
    model.dtype = describe_dtype(config)
    log.info("encoder: text encoder %s on %s (variant %s)", model.dtype, model.device, variant(config))
    return components, model


def describe_dtype(config: EncoderConfig) -> str:
    quantize, _, _ = _settings(config)
    return config.dtype if quantize == "none" else f"{config.dtype} ({quantize} weights)"


def layer_weights(config: EncoderConfig):
    """Where a layer-by-layer build takes the encoder's values from, for a quantized encoder offloaded or spread (its
    bf16 layers then never reach host memory: 48.9 GiB for the released encoder): `random:full`'s draws, or the model
    directory's safetensors files (read tensor by tensor, memory-mapped). None otherwise (the tiny preset, built
    whole)."""
    from h3serve.runtime.models import ModelSource

    quantize, spread, offload = _settings(config)
    if not (staged_on_cpu(config) and (offload or spread) and quantize != "none" and config.model_dir):
        return None
    return ModelSource(config.model_dir).weights("text_encoder")


def int8_store(config: EncoderConfig, revision: str) -> QuantisedStore | None:
    """`[encoder] int8_cache_dir`'s store of the int8 layers, None without one."""
    if not config.int8_cache_dir:
        return None
    return QuantisedStore(Path(config.int8_cache_dir), revision, TORCH_DTYPES[config.dtype], INT8_LAYOUT)


def from_store(store: QuantisedStore, weights, config: EncoderConfig) -> torch.nn.Module | None:
    """The int8 text encoder assigned from `store` (memory-mapped, on the CPU), quantized into it layer by layer
    first when it is not saved yet: each decoder layer filled on the (first) GPU and quantized there, the rest drawn
    there too (where `random:full` draws it for an encoder built without the store, so both hold the same values).
    None when the store could not save it (a full disk: the warning says so), and the start quantizes without it."""
    dtype, device = TORCH_DTYPES[config.dtype], torch.device(config.device)
    layers = Build(
        weights,
        functools.partial(skeleton, weights, dtype),
        device,
        lambda layer, _prefix: quantize_layer(layer, "int8", dtype),
        rest_device=device,
    )
    return store.load_or_build("text_encoder", layers)


def skeleton(weights, dtype: torch.dtype) -> torch.nn.Module:
    """The text encoder on the meta device as the service holds it (h3serve/runtime/models.py drop_unread_parts)."""
    from h3serve.runtime import random_full
    from h3serve.runtime.models import drop_unread_parts

    return drop_unread_parts({"text_encoder": random_full.skeleton(weights.factory, dtype)})["text_encoder"]


def place(
    text_encoder: Qwen3VLForConditionalGeneration, config: EncoderConfig, weights=None, quantized: bool = False
) -> str:
    """Place (and quantize) `text_encoder` as `config` says, in place; returns where it runs, in words.

    The model may be on the CPU (staged, or `quantized` already: assigned from the int8 store), on the meta device
    (built layer by layer from `weights`), or already on `config.device` (nothing to do but quantize)."""
    quantize, spread, offload = _settings(config)
    quantize = "none" if quantized else quantize
    device = torch.device(config.device)
    dtype = TORCH_DTYPES[config.dtype]
    if spread and weights is not None:
        return spread_layer_by_layer(text_encoder, _spread_budget(config), quantize, dtype, weights)
    if spread:
        where = spread_over_gpus(text_encoder, _spread_budget(config))
        if quantize != "none":
            quantize_in_place(text_encoder, quantize, dtype, None)  # each linear on the GPU it was given
        return where
    if offload:
        if quantize != "none":
            quantize_through(text_encoder, quantize, device, weights)
        offload_to_host(text_encoder, device)
        return f"{device} (weights in host memory, cpu_offload)"
    if quantize != "none":
        quantize_in_place(text_encoder, quantize, dtype, device)
    # transformers wraps PreTrainedModel.to in functools.wraps, whose stub loses the method's binding of self
    text_encoder.to(device)  # type: ignore[arg-type]
    return str(device)


def is_target(module: torch.nn.Module, name: str) -> bool:
    """The linears quantization replaces: those of the text decoder layers (see the module docstring)."""
    return isinstance(module, torch.nn.Linear) and name.startswith(DECODER_LAYERS)


def quantize_in_place(model: torch.nn.Module, quantize: str, dtype: torch.dtype, device: torch.device | None) -> int:
    """Quantize the target linears, each moved to `device` first (None: where it is); returns how many."""
    count = sum(1 for name, module in model.named_modules() if is_target(module, name))
    if count == 0:
        raise ValueError(f"the text encoder has no linears under {DECODER_LAYERS!r}: not a Qwen3-VL conditioner?")
    if quantize == "int8":
        _int8(model, device)
    elif quantize == "nf4":
        _nf4(model, dtype, device)
    else:
        raise ValueError(f"quantize must be int8 or nf4, got {quantize!r}")
    log.info("encoder: %d decoder linears quantized to %s", count, quantize)
    return count


def quantize_through(model: Qwen3VLForConditionalGeneration, quantize: str, device: torch.device, weights=None) -> None:
    """Quantize the decoder layers one by one on `device` and bring each back to host memory, for cpu_offload: the
    GPU never holds more than one layer, and host memory gives back each layer's bf16 weights as it goes (the
    released encoder: 48.9 GiB of bf16 become 25.7 GiB of int8 in host memory). A skeleton (on meta) is filled from
    `weights` layer by layer on `device` (the bf16 layers never reach host memory), then the rest (drawn where
    random:full draws it, so the values are the in-process pipeline's)."""
    from h3serve.runtime.sharded_load import fill_module

    layers = model.model.language_model.layers
    for index, layer in enumerate(layers):
        if weights is None:
            layer.to(device)
        else:
            fill_module(layer, weights, f"{DECODER_LAYERS}{index}.", device)
        _int8(layer, None, filter_fn=lambda module, _name: isinstance(module, torch.nn.Linear))
        layer.to("cpu")
    if weights is not None:
        fill_module(model, weights, "", device)
        model.to("cpu")  # type: ignore[arg-type]  # PreTrainedModel.to's functools.wraps stub (place())
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the layers passed through the allocator's cache: give the shared card its memory
    log.info("encoder: %d decoder layers' linears quantized to %s on %s", len(layers), quantize, device)


def quantize_layer(layer: torch.nn.Module, quantize: str, dtype: torch.dtype) -> None:
    """Every linear of one decoder layer quantized where it is."""
    every_linear = lambda module, _name: isinstance(module, torch.nn.Linear)  # noqa: E731
    if quantize == "int8":
        _int8(layer, None, filter_fn=every_linear)
    else:
        _nf4(layer, dtype, None, filter_fn=every_linear)


def build_spread(model: torch.nn.Module, devices: dict[str, torch.device], weights, quantize_layer) -> None:
    """Fill the meta-device skeleton `model` from `weights` where `devices` (a device map: module name -> device)
    puts each part: every decoder layer filled on its device and `quantize_layer(layer)` there before the next
    (one bf16 layer at a time), then everything else. Host memory holds no layer."""
    from h3serve.runtime.sharded_load import fill_module

    def device_of(name: str) -> torch.device:
        owner = max((key for key in devices if key == "" or name == key or name.startswith(key + ".")), key=len)
        return devices[owner]

    layers = cast(torch.nn.ModuleList, model.get_submodule(DECODER_LAYERS.rstrip(".")))
    for index, layer in enumerate(layers):
        prefix = f"{DECODER_LAYERS}{index}"
        fill_module(layer, weights, prefix + ".", device_of(prefix))
        quantize_layer(layer)
    for key, device in devices.items():  # what is left of each part (filled layers stay as they are)
        fill_module(model.get_submodule(key) if key else model, weights, f"{key}." if key else "", device)


def spread_layer_by_layer(
    model: torch.nn.Module, budget: dict[int, int], quantize: str, dtype: torch.dtype, weights
) -> str:
    """`spread` of a quantized encoder from a skeleton: the device map made on the meta device (sized by its bf16
    parameters: a bound on the quantized ones), each part built on its GPU (`build_spread`), then accelerate's hooks
    that move activations between the GPUs."""
    from accelerate import dispatch_model

    device_map = spread_map(model, budget)
    build_spread(
        model,
        {key: torch.device("cuda", index) for key, index in device_map.items()},
        weights,
        lambda layer: quantize_layer(layer, quantize, dtype),
    )
    dispatch_model(model, device_map=device_map)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the bf16 layers passed through the allocators' caches: the cards are shared
    used = sorted(set(device_map.values()))
    log.info("encoder: built layer by layer, %s-quantized, over cuda:%s", quantize, ",".join(map(str, used)))
    return "+".join(f"cuda:{i}" for i in used) + " (spread)"


def _int8(model: torch.nn.Module, device: torch.device | None, filter_fn=is_target) -> None:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    # set_inductor_config=False: nothing here is compiled, and it would change inductor's process-wide settings
    quantize_(model, Int8WeightOnlyConfig(set_inductor_config=False), filter_fn=filter_fn, device=device)


def _nf4(model: torch.nn.Module, dtype: torch.dtype, device: torch.device | None, filter_fn=is_target) -> None:
    try:
        import bitsandbytes as bnb
    except ImportError as exc:
        raise RuntimeError(f"quantize = \"nf4\" needs bitsandbytes (pip install 'h3serve[model,gpu]'): {exc}") from exc

    modules = dict(model.named_modules())
    for name, linear in list(modules.items()):
        if not filter_fn(linear, name):
            continue
        target = device if device is not None else linear.weight.device
        q = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=dtype,
            quant_type="nf4",
            device="meta",
        )
        q.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4", module=q)
        if linear.bias is not None:
            q.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
        q = q.to(target)  # bitsandbytes quantizes on the move to a CUDA device
        parent, _, child = name.rpartition(".")
        setattr(modules[parent], child, q)
        old_hook = getattr(linear, "_hf_hook", None)
        if old_hook is not None:  # a spread model's hooks sit on the decoder layers, not on linears; keep any
            from accelerate.hooks import add_hook_to_module

            add_hook_to_module(q, old_hook)


def _spread_budget(config: EncoderConfig) -> dict[int, int]:
    """Bytes each visible GPU may take: SPREAD_HEADROOM of its free memory, or of memory_limit_gib if lower."""
    budget = {}
    for index in range(torch.cuda.device_count()):
        free, _ = torch.cuda.mem_get_info(index)
        limit = getattr(config, "memory_limit_gib", 0.0)
        if limit:
            free = min(free, int(limit * (1 << 30)))
        budget[index] = int(free * SPREAD_HEADROOM)
    return budget


def spread_map(model: torch.nn.Module, budget: dict[int, int]) -> dict[str, int]:
    """accelerate's balanced device map of `model` over the GPUs of `budget` (index -> bytes), decoder layers and
    vision blocks whole. Raises ValueError when anything would not fit on the GPUs."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = list(getattr(model, "_no_split_modules", None) or ())
    balanced = get_balanced_memory(model, max_memory=dict(budget), no_split_module_classes=no_split)
    device_map = infer_auto_device_map(model, max_memory={**balanced, "cpu": 0}, no_split_module_classes=no_split)
    off = sorted(name for name, where in device_map.items() if not isinstance(where, int))
    if off:
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        raise ValueError(
            f"spread: the text encoder ({total / (1 << 30):.1f} GiB) does not fit the "
            f"{len(budget)} GPUs' free memory ({sum(budget.values()) / (1 << 30):.1f} GiB usable); "
            f"left over: {', '.join(off[:3])}{' ...' if len(off) > 3 else ''}"
        )
    return device_map


def spread_over_gpus(model: torch.nn.Module, budget: dict[int, int]) -> str:
    from accelerate import dispatch_model

    device_map = spread_map(model, budget)
    dispatch_model(model, device_map=device_map)
    used = sorted(set(device_map.values()))
    log.info(
        "encoder: spread over cuda:%s: %s",
        ",".join(map(str, used)),
        "; ".join(f"cuda:{i}: {sum(1 for v in device_map.values() if v == i)} modules" for i in used),
    )
    return "+".join(f"cuda:{i}" for i in used) + " (spread)"


def offload_to_host(
    model: Qwen3VLForConditionalGeneration, device: torch.device, use_stream: bool = True
) -> pinned.Arenas:
    """The weights (on the CPU) kept in pinned host memory, each decoder layer and vision block streamed to `device`
    as it runs (h3serve/runtime/offload.py); returns the arenas that hold them. `use_stream=False`: for tests on
    the CPU."""
    # applied to `model.model`, which the pipeline calls (it reads hidden_states[50] and never runs the top module):
    # diffusers' hooks on the top module would never fire, and with a stream its prefetch hook there re-registers
    # the layer trackers of the two below and fails (one H200)
    started = time.perf_counter()
    language_model = model.model.language_model
    embed, language_model.embed_tokens = language_model.embed_tokens, None
    arenas = stream_from_host(model.model, device, OFFLOAD_BLOCK_MODULES, use_stream)
    # Qwen3VLModel looks tokens up before `language_model` runs, so the embedding is a group of its own, added after
    # `language_model`'s prefetch order is set up: inside that order it was prefetched at the language model's start
    # and held on the GPU through every layer (random:full on one H200: a 3.46 GiB peak, the embedding's 1.45 GiB
    # and two layers)
    language_model.embed_tokens = embed
    stream_from_host(embed, device, use_stream=use_stream, arenas=arenas)
    log.info(
        "encoder: weights pinned in host memory: %d arenas of %d MiB in %.1f s",
        arenas.count,
        pinned.ARENA_BYTES >> 20,
        time.perf_counter() - started,
    )
    return arenas
