"""The `random:full` model source: MiniMax-H3 at its released sizes with random weights, for benchmarks.

Every component is built on the meta device and then filled parameter by parameter (no disk, no download)
in the requested dtype; modules a checkpoint load keeps in fp32 (`_keep_in_fp32_modules`) are fp32 here too.
Each parameter's values are drawn from a seed of its component and name (`fill`), on a GPU whenever one is
present, and then moved to the service's device: processes that place the weights on a GPU or in host memory
(offload) hold the same values, and host placements build in seconds, not the minutes torch's own init takes
on a CPU (221 s for the transformer on one H200 machine). Weight values do not
change speed, so timings equal the released model's.

- transformer / transformer_ref / vae: the classes' default configs, which are the released ones.
- audio_vae: the default config, with identity latent statistics (the defaults are None and the decode
  step cannot run with them; the released values are not public).
- text_encoder: Qwen3-VL-32B's sizes (the released MiniMax-H3 conditioner), built with 51 of its 64
  decoder layers: the pipeline reads `hidden_states[50]` (after layer 50, before the final norm), which a
  51-layer stack computes exactly, so the 13 layers it never uses are not built. Its vocabulary has the
  released size; its vision token ids are the tokenizer's.
- under FSDP2 each DiT rank materialises only its shards, drawn by the same rule per block of rows
  (h3serve/runtime/sharded_load.py, `RandomWeights`).
- tokenizer / processor: the tiny preset's byte-level ones (one token per prompt byte), which is all a
  timing needs; schedulers: the released shifts.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch

from h3serve.model import presets
from h3serve.runtime import tiny


def skeleton(factory: Callable[[], torch.nn.Module], dtype: torch.dtype) -> torch.nn.Module:
    """`factory()` with its parameters on the meta device and its buffers computed on the CPU at construction
    (non-persistent ones, such as the rope frequencies, are in no checkpoint), in fp32 like diffusers' loader
    computes them; then the dtypes a checkpoint load gives (`_keep_in_fp32_modules` stay fp32)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = factory().eval()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(torch.float32 if keeps_fp32(model, name) else dtype)
    return model


def keeps_fp32(model: torch.nn.Module, name: str) -> bool:
    """Whether parameter or buffer `name` lies under the model's `_keep_in_fp32_modules` (diffusers' rule)."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    return any(module in name.split(".") for module in keep)


def fill(tensor: torch.Tensor, component: str, name: str, start: int = 0, shape: torch.Size | None = None) -> None:
    """Seeded values in the ranges of PyTorch's default init (weights of 2+ dims uniform within 1/sqrt(fan-in),
    norm scales 1, biases 0), so 50 random blocks stay finite. `tensor` holds rows `start...` of parameter `name`
    of the whole `shape` (default: the tensor is the whole parameter); the seed names the component, the
    parameter and the first row."""
    shape = tensor.shape if shape is None else shape
    if name.endswith("bias"):
        tensor.zero_()
    elif len(shape) == 1:
        tensor.fill_(1.0)
    else:
        generator = torch.Generator(tensor.device).manual_seed(zlib.crc32(f"{component}.{name}@{start}".encode()))
        tensor.uniform_(-(shape[1:].numel() ** -0.5), shape[1:].numel() ** -0.5, generator=generator)


def materialise(model: torch.nn.Module, component: str, device: str) -> torch.nn.Module:
    """Fill the skeleton's parameters (drawn on a GPU when there is one, the values depend only on that) and move
    them and the buffers to `device`, one tensor at a time."""
    source = (
        torch.device(device)
        if torch.device(device).type == "cuda"
        else (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    )
    with torch.no_grad():
        for owner, module in model.named_modules():
            for attribute, param in list(module.named_parameters(recurse=False)):
                values = torch.empty(param.shape, dtype=param.dtype, device=source)
                fill(values, component, f"{owner}.{attribute}" if owner else attribute)
                module._parameters[attribute] = torch.nn.Parameter(values.to(device), param.requires_grad)
            for attribute, buffer in list(module.named_buffers(recurse=False)):
                module._buffers[attribute] = buffer.to(device)
    return model


def text_encoder_factory(tokenizer, layers: int = presets.TEXT_ENCODER_LAYERS) -> Callable[[], torch.nn.Module]:
    from transformers import Qwen3VLForConditionalGeneration

    config = tiny.qwen3_vl_config(
        tokenizer, {**presets.QWEN3_VL_32B_TEXT, "num_hidden_layers": layers}, presets.QWEN3_VL_32B_VISION
    )
    return lambda: Qwen3VLForConditionalGeneration(config)


def model_factory(name: str) -> Callable[[], torch.nn.Module]:
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel

    if name in ("transformer", "transformer_ref"):
        return MiniMaxH3Transformer3DModel
    if name == "vae":
        return AutoencoderKLMiniMaxH3
    if name == "audio_vae":
        return lambda: AutoencoderKLMiniMaxH3Audio(**presets.RANDOM_FULL_AUDIO_VAE)
    if name == "text_encoder":
        return text_encoder_factory(presets.tiny_tokenizer())
    raise KeyError(f"the {presets.RANDOM_FULL} source has no component {name!r}")


def build_component(name: str, device: str, dtype: torch.dtype) -> Any:
    """One component by its pipeline name; models are seeded from the name and built on `device`."""
    if name in ("tokenizer", "processor", "scheduler", "audio_scheduler"):
        return tiny.build_component(name)
    model = skeleton(model_factory(name), dtype)
    return model if torch.device(device).type == "meta" else materialise(model, name, device)


def build(names: list[str], device: str, dtype: torch.dtype) -> dict[str, Any]:
    return {name: build_component(name, device, dtype) for name in names}
