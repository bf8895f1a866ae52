"""The built-in `tiny` model preset: the real MiniMax-H3 classes at toy sizes, random weights.

Every service builds the components it needs from here with a fixed per-component seed, so separately
started processes hold bit-identical weights without sharing a file. `write_tiny_model` saves the same
components in the released diffusers layout so the `--model-dir` path is exercised by the tests too.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

TINY_REVISION = "tiny-v1"

TRANSFORMER = dict(
    num_attention_heads=2, attention_head_dim=16, hidden_size=32, num_layers=2, num_refiner_layers=1,
    ffn_dim=64, in_channels=24, audio_in_channels=32, patch_size=(1, 2, 2), text_dim=32, freq_dim=16,
    time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2, rope_theta=10000.0,
)
VAE = dict(
    in_channels=3, out_channels=3, latent_channels=24, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
    spatial_downsample_factors=(2, 2, 2, 2), temporal_downsample_factors=(1, 2, 2, 1), norm_num_groups=4,
    decoder_num_layers=1, decoder_num_attention_heads=2, decoder_attention_head_dim=16,
    decoder_num_register_tokens=1, decoder_ffn_mult=1, clip_length=17, token_drop=3,
    latents_mean=(0.0,) * 24, latents_std=(1.0,) * 24,
)
AUDIO_VAE = dict(
    encoder_dim=4, encoder_rates=(8, 10, 10), latent_dim=64, latent_channels=32, num_attention_heads=2,
    decoder_dim=32, decoder_rates=(10, 10, 8), decoder_kernel_sizes=(20, 20, 16), resblock_kernel_sizes=(3,),
    resblock_dilation_sizes=((1,),), sampling_rate=32000, latents_mean=[0.0] * 32, latents_std=[1.0] * 32,
)
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]


def seeded(name: str):
    """Seed torch's global RNG from the component name, so weights do not depend on build order."""
    torch.manual_seed(zlib.crc32(name.encode()))


def build_tokenizer():
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    tokenizer = Qwen2Tokenizer(vocab={c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    return tokenizer


def build_processor(tokenizer):
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    image = Qwen2VLImageProcessorPil(
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
    )
    video = Qwen3VLVideoProcessor(
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        size={"shortest_edge": 32 * 32 * 2, "longest_edge": 64 * 64 * 16},
    )
    return Qwen3VLProcessor(image_processor=image, tokenizer=tokenizer, video_processor=video)


TEXT_ENCODER_TEXT = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=51, num_attention_heads=2, num_key_value_heads=1,
    head_dim=16, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2], "mrope_interleaved": True},
)
TEXT_ENCODER_VISION = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=64, deepstack_visual_indexes=[1],
)


def qwen3_vl_config(tokenizer, text: dict, vision: dict):
    """A Qwen3-VL config whose vision token ids are `tokenizer`'s (the byte-level one has its own ids)."""
    from transformers import Qwen3VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return Qwen3VLConfig(
        text_config=text, vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )


def build_text_encoder(tokenizer):
    from transformers import Qwen3VLForConditionalGeneration

    config = qwen3_vl_config(tokenizer, {"vocab_size": len(tokenizer), **TEXT_ENCODER_TEXT}, TEXT_ENCODER_VISION)
    seeded("text_encoder")
    return Qwen3VLForConditionalGeneration(config).eval()


def build_component(name: str):
    """Build one tiny component by its pipeline component name."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel
    from diffusers.schedulers import MiniMaxH3Scheduler

    if name in ("transformer", "transformer_ref"):
        seeded(name)
        return MiniMaxH3Transformer3DModel(**TRANSFORMER).eval()
    if name == "vae":
        seeded(name)
        return AutoencoderKLMiniMaxH3(**VAE).eval()
    if name == "audio_vae":
        seeded(name)
        return AutoencoderKLMiniMaxH3Audio(**AUDIO_VAE).eval()
    if name == "scheduler":
        return MiniMaxH3Scheduler(shift=12.0)
    if name == "audio_scheduler":
        return MiniMaxH3Scheduler(shift=3.0)
    if name == "tokenizer":
        return build_tokenizer()
    if name == "processor":
        return build_processor(build_tokenizer())
    if name == "text_encoder":
        return build_text_encoder(build_tokenizer())
    raise KeyError(f"the tiny preset has no component {name!r}")


ALL_COMPONENTS = ("transformer", "transformer_ref", "vae", "audio_vae", "text_encoder", "tokenizer",
                  "processor", "scheduler", "audio_scheduler")


def write_tiny_model(directory: str | Path) -> Path:
    """Save every tiny component in the released diffusers layout (modular_model_index.json + subfolders)."""
    from diffusers.modular_pipelines import MiniMaxH3Blocks

    directory = Path(directory)
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(**{name: build_component(name) for name in ALL_COMPONENTS})
    pipe.save_pretrained(str(directory), overwrite_modular_index=True)
    return directory
