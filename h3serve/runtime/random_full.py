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
- tokenizer / processor: the tiny preset's byte-level ones (one token per prompt byte), which is all a
  timing needs; schedulers: the released shifts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from h3serve.runtime import tiny

SOURCE = "random:full"
REVISION = "random-full-v1"
TEXT_ENCODER_LAYERS = 51  # > text_encoder_layer (50): the last one whose output the pipeline reads
QWEN3_VL_32B_TEXT = dict(
    vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
    num_key_value_heads=8, head_dim=128, hidden_act="silu", max_position_embeddings=262144, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                     "mrope_interleaved": True},
)
QWEN3_VL_32B_VISION = dict(
    depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, hidden_act="gelu_pytorch_tanh", patch_size=16,
    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=5120, num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24],
)
AUDIO_VAE = dict(latents_mean=[0.0] * 32, latents_std=[1.0] * 32)


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
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if keep & set(name.split(".")) and tensor.is_floating_point():
            tensor.data = tensor.data.float()
    return model


def text_encoder_factory(tokenizer, layers: int = TEXT_ENCODER_LAYERS) -> Callable[[], torch.nn.Module]:
    from transformers import Qwen3VLForConditionalGeneration

    config = tiny.qwen3_vl_config(tokenizer, {**QWEN3_VL_32B_TEXT, "num_hidden_layers": layers}, QWEN3_VL_32B_VISION)
    return lambda: Qwen3VLForConditionalGeneration(config)


def _model_factory(name: str) -> Callable[[], torch.nn.Module]:
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel

    if name in ("transformer", "transformer_ref"):
        return MiniMaxH3Transformer3DModel
    if name == "vae":
        return AutoencoderKLMiniMaxH3
    if name == "audio_vae":
        return lambda: AutoencoderKLMiniMaxH3Audio(**AUDIO_VAE)
    if name == "text_encoder":
        return text_encoder_factory(tiny.build_tokenizer())
    raise KeyError(f"the {SOURCE} source has no component {name!r}")


def build_component(name: str, device: str, dtype: torch.dtype) -> Any:
    """One component by its pipeline name; models are seeded from the name and built on `device`."""
    if name in ("tokenizer", "processor", "scheduler", "audio_scheduler"):
        return tiny.build_component(name)
    factory = _model_factory(name)
    tiny.seeded(name)
    return build_in_place(factory, device, dtype)


def build(names: list[str], device: str, dtype: torch.dtype) -> dict[str, Any]:
    return {name: build_component(name, device, dtype) for name in names}
