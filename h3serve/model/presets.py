"""The model configurations h3serve builds without a model directory, as data (torch-free).

- `tiny`: the real MiniMax-H3 classes at toy sizes with random weights; the demo and every CPU test
  run it (h3serve/runtime/tiny.py builds it). Its tokenizer is byte-level BPE (one token per byte) with
  Qwen's special tokens, so nothing is downloaded.
- `random:full`: every component at its released size with random weights, for benchmarks
  (h3serve/runtime/random_full.py builds it on the device).

The gateway reads the tiny tokenizer and processor settings from here to count text rows exactly.
"""

from __future__ import annotations

from typing import Any

TINY = "tiny"
TINY_REVISION = "tiny-v1"
RANDOM_FULL = "random:full"
RANDOM_FULL_REVISION = "random-full-v2"  # v2: values drawn per parameter (random_full.fill)

TINY_TRANSFORMER: dict[str, Any] = dict(
    num_attention_heads=2,
    attention_head_dim=16,
    hidden_size=32,
    num_layers=2,
    num_refiner_layers=1,
    ffn_dim=64,
    in_channels=24,
    audio_in_channels=32,
    patch_size=(1, 2, 2),
    text_dim=32,
    freq_dim=16,
    time_embed_hidden_dim=32,
    time_embed_dim=16,
    rope_freq_dim=2,
    rope_theta=10000.0,
)
TINY_VAE: dict[str, Any] = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=24,
    block_out_channels=(8, 8, 8, 8),
    layers_per_block=1,
    spatial_downsample_factors=(2, 2, 2, 2),
    temporal_downsample_factors=(1, 2, 2, 1),
    norm_num_groups=4,
    decoder_num_layers=1,
    decoder_num_attention_heads=2,
    decoder_attention_head_dim=16,
    decoder_num_register_tokens=1,
    decoder_ffn_mult=1,
    clip_length=17,
    token_drop=3,
    latents_mean=(0.0,) * 24,
    latents_std=(1.0,) * 24,
)
TINY_AUDIO_VAE: dict[str, Any] = dict(
    encoder_dim=4,
    encoder_rates=(8, 10, 10),
    latent_dim=64,
    latent_channels=32,
    num_attention_heads=2,
    decoder_dim=32,
    decoder_rates=(10, 10, 8),
    decoder_kernel_sizes=(20, 20, 16),
    resblock_kernel_sizes=(3,),
    resblock_dilation_sizes=((1,),),
    sampling_rate=32000,
    latents_mean=[0.0] * 32,
    latents_std=[1.0] * 32,
)
TINY_TEXT_ENCODER_TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=51,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2], "mrope_interleaved": True},
)
TINY_TEXT_ENCODER_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=32,
    num_position_embeddings=64,
    deepstack_visual_indexes=[1],
)
_PIXEL_STATS = dict(image_mean=[0.5] * 3, image_std=[0.5] * 3)
TINY_IMAGE_PROCESSOR: dict[str, Any] = dict(
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    **_PIXEL_STATS,
    size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
)
TINY_VIDEO_PROCESSOR: dict[str, Any] = dict(
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    **_PIXEL_STATS,
    size={"shortest_edge": 32 * 32 * 2, "longest_edge": 64 * 64 * 16},
)
SPECIAL_TOKENS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# random:full. The text encoder is Qwen3-VL-32B's size (the released MiniMax-H3 conditioner) built with 51 of its
# 64 decoder layers: the pipeline reads `hidden_states[50]`, which a 51-layer stack computes exactly.
RELEASED_ATTENTION_SHAPE = (56, 128)  # the transformer's heads and head dim (its class defaults)
TEXT_ENCODER_LAYERS = 51
QWEN3_VL_32B_TEXT = dict(
    vocab_size=151936,
    hidden_size=5120,
    intermediate_size=25600,
    num_hidden_layers=64,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
    hidden_act="silu",
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 5e6,
        "mrope_section": [24, 20, 20],
        "mrope_interleaved": True,
    },
)
QWEN3_VL_32B_VISION = dict(
    depth=27,
    hidden_size=1152,
    intermediate_size=4304,
    num_heads=16,
    hidden_act="gelu_pytorch_tanh",
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=5120,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24],
)
# The audio VAE's class defaults leave the latent statistics unset, which its decode cannot run with; the
# released values are not public, so the identity stands in.
RANDOM_FULL_AUDIO_VAE = dict(latents_mean=[0.0] * 32, latents_std=[1.0] * 32)


def tiny_tokenizer():
    """Byte-level BPE with no merges (ids 0..255) plus Qwen's special tokens (transformers' tokenizer, no torch)."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    tokenizer = Qwen2Tokenizer(vocab={c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    return tokenizer


def tiny_processor_config() -> dict:
    """The tiny processor's settings in the form of a saved `processor_config.json`."""
    return {"image_processor": TINY_IMAGE_PROCESSOR, "video_processor": TINY_VIDEO_PROCESSOR}
