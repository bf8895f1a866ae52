"""The `random:full` model source: MiniMax-H3's released sizes, built on the meta device (no memory used), and its
weights, drawn per parameter (on the tiny preset's modules: the released sizes do not fit a CI machine, and the rule
is the same at any size)."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel

from h3serve.model import presets
from h3serve.runtime import random_full
from h3serve.runtime.models import ModelSource
from h3serve.runtime.sharded_load import LocalRows, RandomWeights

MODELS = ["transformer", "transformer_ref", "vae", "audio_vae", "text_encoder"]


def params_by_dtype(module: torch.nn.Module) -> Counter:
    counts = Counter()
    for param in module.parameters():
        counts[param.dtype] += param.numel()
    return counts


@pytest.fixture(scope="module")
def parts():
    source = ModelSource(presets.RANDOM_FULL)
    assert source.revision() == presets.RANDOM_FULL_REVISION and source.label == "random:full"
    return source.load([*MODELS, "tokenizer", "processor", "scheduler", "audio_scheduler"], "meta", "bfloat16")


def test_diffusers_models_have_the_released_sizes_with_their_fp32_modules_kept(parts):
    for name in ("transformer", "transformer_ref"):
        # 17.2 M parameters of proj_in, audio_proj_in, time_embedder, proj_out, audio_proj_out stay fp32.
        assert params_by_dtype(parts[name]) == {torch.bfloat16: 33_105_770_752, torch.float32: 17_222_144}
    vae = parts["vae"]
    assert sum(params_by_dtype(vae).values()) == 2_603_868_984
    assert {p.dtype for p in vae.encoder.parameters()} == {torch.float32}
    assert {p.dtype for p in vae.decoder.parameters()} == {torch.bfloat16, torch.float32}  # blocks bf16, norms fp32
    assert params_by_dtype(parts["audio_vae"]) == {torch.float32: 151_321_489}  # all of it pinned
    assert list(parts["audio_vae"].config.latents_mean) == [0.0] * 32
    assert all(parts[name].device.type == "meta" for name in MODELS)


def test_text_encoder_is_qwen3_vl_32b_truncated_after_the_layer_the_pipeline_reads(parts):
    from diffusers.modular_pipelines import MiniMaxH3Blocks

    encoder = parts["text_encoder"]
    read = MiniMaxH3Blocks().init_pipeline().text_encoder_layer
    assert read == 50 and encoder.config.text_config.num_hidden_layers == read + 1
    text = encoder.model.language_model
    assert len(text.layers) == 51 and tuple(text.embed_tokens.weight.shape) == (151_936, 5120)
    layer = text.layers[0]
    assert tuple(layer.self_attn.q_proj.weight.shape) == (64 * 128, 5120)
    assert tuple(layer.self_attn.k_proj.weight.shape) == (8 * 128, 5120)
    assert tuple(layer.mlp.gate_proj.weight.shape) == (25_600, 5120)
    assert len(encoder.model.visual.blocks) == 27 and encoder.model.visual.merger.linear_fc2.out_features == 5120
    assert params_by_dtype(encoder) == {torch.bfloat16: 26_240_699_376}
    assert isinstance(encoder.lm_head, torch.nn.Identity)
    # The released 64-layer conditioner is 33.36 B parameters; the 13 layers after the one read and the head
    # (as many parameters as the embedding) are left out.
    with torch.device("meta"):
        released = random_full.text_encoder_factory(parts["tokenizer"], layers=64)()
    per_layer = sum(p.numel() for p in layer.parameters())
    head = text.embed_tokens.weight.numel()
    assert sum(p.numel() for p in released.parameters()) == 33_357_390_064 == 26_240_699_376 + 13 * per_layer + head
    # Vision blocks are addressed by the tokenizer's own ids.
    assert encoder.config.image_token_id == parts["tokenizer"].convert_tokens_to_ids("<|image_pad|>")


def test_small_components_are_the_tiny_presets(parts):
    assert len(parts["tokenizer"]) == len(presets.tiny_tokenizer())
    assert (parts["scheduler"].config.shift, parts["audio_scheduler"].config.shift) == (12.0, 3.0)
    with pytest.raises(KeyError, match="no component 'unet'"):
        random_full.build_component("unet", "meta", torch.bfloat16)


def test_the_bf16_audio_vae_decodes_its_fp32_buffers_included():
    # Its resampling filters are buffers computed at construction; a checkpoint load keeps them fp32 with
    # the rest of the pinned decoder, and so must this source (a bf16 filter fails the decode on dtype).
    audio_vae = random_full.build_component("audio_vae", "cpu", torch.bfloat16)
    assert {b.dtype for b in audio_vae.buffers()} == {torch.float32}
    with torch.no_grad():
        waveform = audio_vae.decode(torch.randn(2, 32, 2, generator=torch.Generator().manual_seed(0))).sample
    assert waveform.shape == (2, 1, 2 * audio_vae.hop_length) and waveform.dtype == torch.float32


TINY = functools.partial(MiniMaxH3Transformer3DModel, **presets.TINY_TRANSFORMER)


def built(factory=TINY, component: str = "transformer", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return random_full.materialise(random_full.skeleton(factory, dtype), component, "cpu")


def test_every_parameter_is_seeded_by_its_component_and_name():
    first, again, other = built(), built(), built(component="transformer_ref")
    for (name, a), b, c in zip(first.named_parameters(), again.parameters(), other.parameters(), strict=True):
        assert a.device.type == "cpu" and torch.equal(a, b), name
        if a.dim() > 1:
            assert not torch.equal(a, c), f"{name}: another component draws other values"


def test_values_stay_in_the_ranges_of_torchs_default_init_and_the_model_runs_finite():
    model = built()
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            assert not param.any(), name
        elif param.dim() == 1:
            assert torch.equal(param, torch.ones_like(param)), name
        else:
            bound = param.shape[1:].numel() ** -0.5
            assert param.abs().max() <= bound and param.std() > bound / 4, name  # uniform, not collapsed
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_whole_parameter_equals_the_first_rank_shard_of_the_sharded_loader():
    model = built()
    name, whole = next((n, p) for n, p in model.named_parameters() if p.dim() > 1)
    rows = torch.empty(whole.shape[0] // 2, *whole.shape[1:])
    RandomWeights("transformer").fill(name, LocalRows(rows, 0, whole.shape))
    assert torch.equal(rows, whole[: rows.shape[0]]), "one rule, seeded by the parameter and its first row"


def test_fp32_modules_stay_fp32_and_the_rest_takes_the_dtype():
    model = built(dtype=torch.bfloat16)
    kept = {n for n, _ in model.named_parameters() if random_full.keeps_fp32(model, n)}
    assert kept and len(kept) < len(list(model.parameters())), "proj_in, time_embedder, ...: fp32; the blocks: bf16"
    for name, tensor in model.named_parameters():
        assert tensor.dtype == (torch.float32 if name in kept else torch.bfloat16), name
