"""Builds the `tiny` preset (h3serve/model/presets.py): the real MiniMax-H3 classes at toy sizes, random weights.

Every service builds the components it needs from here with a fixed per-component seed, so separately
started processes hold bit-identical weights without sharing a file. `write_tiny_model` saves the same
components in the released diffusers layout so the `--model-dir` path is exercised by the tests too.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from h3serve.model import presets
from h3serve.model.adapters import DEFAULT_SHIFTS

ALL_COMPONENTS = (
    "transformer",
    "transformer_ref",
    "vae",
    "audio_vae",
    "text_encoder",
    "tokenizer",
    "processor",
    "scheduler",
    "audio_scheduler",
)


def seeded(name: str):
    """Seed torch's global RNG from the component name, so weights do not depend on build order."""
    torch.manual_seed(zlib.crc32(name.encode()))


def build_processor(tokenizer):
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(**presets.TINY_IMAGE_PROCESSOR),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(**presets.TINY_VIDEO_PROCESSOR),
    )


def qwen3_vl_config(tokenizer, text: dict, vision: dict):
    """A Qwen3-VL config whose vision token ids are `tokenizer`'s (the byte-level one has its own ids)."""
    from transformers import Qwen3VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in presets.SPECIAL_TOKENS}
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def build_text_encoder(tokenizer):
    from transformers import Qwen3VLForConditionalGeneration

    config = qwen3_vl_config(
        tokenizer, {"vocab_size": len(tokenizer), **presets.TINY_TEXT_ENCODER_TEXT}, presets.TINY_TEXT_ENCODER_VISION
    )
    seeded("text_encoder")
    return Qwen3VLForConditionalGeneration(config).eval()


def build_component(name: str):
    """Build one tiny component by its pipeline component name."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel
    from diffusers.schedulers import MiniMaxH3Scheduler

    models = {
        "transformer": (MiniMaxH3Transformer3DModel, presets.TINY_TRANSFORMER),
        "transformer_ref": (MiniMaxH3Transformer3DModel, presets.TINY_TRANSFORMER),
        "vae": (AutoencoderKLMiniMaxH3, presets.TINY_VAE),
        "audio_vae": (AutoencoderKLMiniMaxH3Audio, presets.TINY_AUDIO_VAE),
    }
    if name in models:
        cls, config = models[name]
        seeded(name)
        return cls(**config).eval()
    if name in ("scheduler", "audio_scheduler"):
        shift = DEFAULT_SHIFTS["flow_shift" if name == "scheduler" else "audio_flow_shift"]
        return MiniMaxH3Scheduler(shift=shift)
    if name == "tokenizer":
        return presets.tiny_tokenizer()
    if name == "processor":
        return build_processor(presets.tiny_tokenizer())
    if name == "text_encoder":
        return build_text_encoder(presets.tiny_tokenizer())
    raise KeyError(f"the tiny preset has no component {name!r}")


def write_tiny_model(directory: str | Path) -> Path:
    """Save every tiny component in the released diffusers layout (modular_model_index.json + subfolders)."""
    from diffusers.modular_pipelines import MiniMaxH3Blocks

    directory = Path(directory)
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(**{name: build_component(name) for name in ALL_COMPONENTS})
    pipe.save_pretrained(str(directory), overwrite_modular_index=True)
    return directory
