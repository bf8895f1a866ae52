"""The `random:full` model source: MiniMax-H3 at its released sizes with random weights, for benchmarks.

Every component is built directly on the service's device in the requested dtype (no disk, no download);
modules a checkpoint load keeps in fp32 (`_keep_in_fp32_modules`) are fp32 here too. Each component is
seeded from its name, as in the tiny preset, so separately started processes on the same kind of device
hold identical weights. Weight values do not change speed, so timings equal the released model's.

- transformer / transformer_ref / vae: the classes' default configs, which are the released ones.
- audio_vae: the default config, with identity latent statistics (the defaults are None and the decode
  step cannot run with them; the released values are not public).
- text_encoder: Qwen3-VL-32B's sizes (the released MiniMax-H3 conditioner), built with 51 of its 64
  decoder layers: the pipeline reads `hidden_states[50]` (after layer 50, before the final norm), which a
  51-layer stack computes exactly, so the 13 layers it never uses are not built. Its vocabulary has the
  released size; its vision token ids are the tokenizer's.
- under FSDP2 each DiT rank materialises only its shards, with values of its own
  (h3serve/runtime/sharded_load.py, `RandomWeights`).
- tokenizer / processor: the tiny preset's byte-level ones (one token per prompt byte), which is all a
  timing needs; schedulers: the released shifts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from h3serve.model import presets
from h3serve.runtime import tiny


def build_in_place(factory: Callable[[], torch.nn.Module], device: str, dtype: torch.dtype) -> torch.nn.Module:
    """`factory()` allocated on `device` in `dtype`; floating parameters and buffers under
    `_keep_in_fp32_modules` become fp32, as loading a checkpoint keeps them (buffers too: the audio VAE's
    resampling filters are computed at construction, in the default dtype)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = factory().eval()
    finally:
        torch.set_default_dtype(previous)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if keeps_fp32(model, name) and tensor.is_floating_point():
            tensor.data = tensor.data.float()
    return model


def keeps_fp32(model: torch.nn.Module, name: str) -> bool:
    """Whether parameter or buffer `name` lies under the model's `_keep_in_fp32_modules` (diffusers' rule)."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    return any(module in name.split(".") for module in keep)


def text_encoder_factory(tokenizer, layers: int = presets.TEXT_ENCODER_LAYERS) -> Callable[[], torch.nn.Module]:
    from transformers import Qwen3VLForConditionalGeneration

    config = tiny.qwen3_vl_config(tokenizer, {**presets.QWEN3_VL_32B_TEXT, "num_hidden_layers": layers},
                                presets.QWEN3_VL_32B_VISION)
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
    factory = model_factory(name)
    tiny.seeded(name)
    return build_in_place(factory, device, dtype)


def build(names: list[str], device: str, dtype: torch.dtype) -> dict[str, Any]:
    return {name: build_component(name, device, dtype) for name in names}
