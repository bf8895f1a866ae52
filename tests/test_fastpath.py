"""The fast-path options refuse what cannot run here, at start and with the reason."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from bench.common import Size, denoise_spec
from h3serve.common.config import DiTConfig, VaeConfig
from h3serve.runtime import compile_cache, fastpath
from h3serve.runtime.fastpath import FastPath
from h3serve.runtime.tiny import build_component
from h3serve.services.dit import warmup
from h3serve.services.dit.runner import DenoiseRunner, served


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn-4 is installed here")
def test_flash4_without_its_package_fails_with_the_reason():
    with pytest.raises(RuntimeError, match="attention backend 'flash4' needs the flash-attn-4 package"):
        fastpath.apply(build_component("transformer"), FastPath(attention="flash4"))


def test_an_unknown_attention_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="backend='no-such-kernel'"):
        fastpath.apply(build_component("vae"), FastPath(attention="no-such-kernel"))


def test_fp8_needs_bf16_weights():
    with pytest.raises(ValueError, match='fp8 needs dtype = "bfloat16"'):
        FastPath.of(DiTConfig(fp8=True))
    fast = FastPath.of(DiTConfig(dtype="bfloat16", fp8=True, compile=True, compile_dynamic=False))
    assert fast.describe() == "native+compile+fp8"


def test_the_default_fast_path_is_diffusers_native_eager():
    assert FastPath.of(VaeConfig()) == FastPath(attention="native", compile=False, fp8=False)


@pytest.mark.skipif(importlib.util.find_spec("cudnn") is not None, reason="nvidia-cudnn-frontend is installed here")
def test_fp8_attention_without_the_cudnn_frontend_fails_with_the_reason():
    with pytest.raises(RuntimeError, match="attention backend 'cudnn_fp8' needs the nvidia-cudnn-frontend package"):
        fastpath.apply(build_component("transformer"), FastPath(attention="cudnn_fp8"))


def test_fast_paths_name_their_options_and_which_change_the_numbers():
    fast = FastPath(attention="cudnn_fp8", compile=True)
    assert fast.describe() == "cudnn_fp8+compile" and fast.lossy
    assert FastPath(fp8=True).lossy and not FastPath(attention="flash4", compile=True).lossy


def test_compile_dynamic_needs_compile_and_is_the_dits_default():
    with pytest.raises(ValueError, match="compile_dynamic needs compile = true"):
        FastPath(dynamic=True)
    assert FastPath.of(DiTConfig(compile=True)).describe() == "native+compile+dynamic"
    assert FastPath.of(DiTConfig()) == FastPath(), "without compile there is nothing to compile dynamically"
    assert not FastPath.of(VaeConfig(compile=True)).dynamic, "the VAE keeps torch's default"
    assert warmup.prompt_lengths(DiTConfig(compile=True)) == [256], "one rank: any length after (the test below)"
    assert warmup.prompt_lengths(DiTConfig(compile=True, world_size=2)) == [256, 255, 254, 253], "each residue mod 4"
    assert warmup.prompt_lengths(DiTConfig(compile=True, compile_dynamic=False)) == [256, 255, 254]
    assert warmup.steps(DiTConfig(compile=True)) == 2, "one forward: its graph serves both variants (the test below)"
    assert [warmup.steps(DiTConfig(**c)) for c in ({}, {"compile": True, "world_size": 2})] == [3, 3]
    assert warmup.steps(DiTConfig(compile=True, warmup_steps=4)) == 4, "the config's own count wins"


@pytest.mark.parametrize("dynamic,recompiles", [(True, False), (False, True)])
def test_a_dynamic_compile_runs_a_new_canvas_and_prompt_length_without_compiling(dynamic, recompiles):
    torch._dynamo.reset()
    parts = {
        "transformer": build_component("transformer"),
        "scheduler": build_component("scheduler"),
        "audio_scheduler": build_component("audio_scheduler"),
    }
    fastpath.apply(parts["transformer"], FastPath(compile=True, dynamic=dynamic))
    runner = DenoiseRunner(parts, served(["t2va"]))

    def graphs_of(size: str, tokens: int, forwards: int) -> int:
        embeds = torch.randn(
            1, tokens, parts["transformer"].config.text_dim, generator=torch.Generator().manual_seed(0)
        )
        before = compile_cache.compiled_graphs()
        runner.run(
            denoise_spec(Size.parse(size), forwards=forwards),
            embeds,
            torch.ones(tokens, dtype=torch.int64),
            lambda step, total: None,
        )
        return compile_cache.compiled_graphs() - before

    # the first call is the warm-up's: one forward when dynamic (warmup.steps), both variants when static
    warm_forwards = warmup.steps(DiTConfig(compile=True, compile_dynamic=dynamic)) - 1
    assert graphs_of("32x64x124", 12, warm_forwards) > 0, "the warm-up compiles"
    # dynamic: a request's both forward variants, at a new size and prompt length, compile nothing more;
    # static: a new size makes torch compile a dynamic graph
    assert (graphs_of("64x32x141", 7, 2) > 0) == recompiles


def test_inductor_tuning_is_the_configs_choice_not_a_side_effect():
    # torchao's fp8 config turns Inductor's coordinate-descent tuning on for the whole process unless told not to:
    # at 480x832x124 on one H200 it was 125 s of a 153 s cold compile (docs/performance.md, "Warm start")
    with pytest.raises(ValueError, match="compile_tuning needs compile = true"):
        FastPath.of(VaeConfig(compile_tuning=True))
    assert FastPath.of(DiTConfig(compile=True, compile_tuning=True)).describe() == "native+compile+dynamic+tune"
    import torch._inductor.config as inductor

    for tune in (True, False):
        fastpath.apply(build_component("transformer"), FastPath(compile=True, tune=tune))
        assert inductor.coordinate_descent_tuning is tune


def test_compiling_blocks_again_compiles_their_own_forward_not_the_compiled_one():
    transformer = build_component("transformer")
    fastpath.compile_blocks(transformer, FastPath(compile=True))
    blocks = [b for b in transformer.modules() if type(b).__name__ in transformer._repeated_blocks]
    first = [b.forward for b in blocks]
    fastpath.compile_blocks(transformer, FastPath(compile=True, dynamic=True))  # the benches' variant ladder
    for block, before in zip(blocks, first, strict=True):
        assert block.forward is not before
        assert block.forward._torchdynamo_orig_callable == vars(block)[fastpath.EAGER_FORWARD]
    assert all(
        len(b._forward_pre_hooks) == (1 if type(b).__name__ == "MiniMaxH3TransformerBlock" else 0) for b in blocks
    ), "the noise-level rows are marked once per block"


def test_one_graph_per_block_kind_serves_both_forward_variants():
    # a request's first forward has one noise level (video and audio start together), the later ones two: with
    # the AdaLN rows' count left unbacked, torch compiles neither block kind twice
    torch._dynamo.reset()
    parts = {
        "transformer": build_component("transformer"),
        "scheduler": build_component("scheduler"),
        "audio_scheduler": build_component("audio_scheduler"),
    }
    fastpath.apply(parts["transformer"], FastPath(compile=True, dynamic=True))
    embeds = torch.randn(1, 12, parts["transformer"].config.text_dim, generator=torch.Generator().manual_seed(0))
    graphs = compile_cache.compiled_graphs()
    DenoiseRunner(parts, served(["t2va"])).run(
        denoise_spec(Size.parse("32x64x124"), forwards=3),
        embeds,
        torch.ones(12, dtype=torch.int64),
        lambda step, total: None,
    )
    assert compile_cache.compiled_graphs() - graphs == len(parts["transformer"]._repeated_blocks)


@pytest.mark.parametrize("floor", [fastpath.ZERO_ROW_FLOOR, None])
def test_a_vae_decoder_in_fp8_quantises_its_zero_token_to_zeros_not_nan(fp8_on_cpu, monkeypatch, floor):
    """The ViT decoder appends an all-zero token to every tile; a rowwise scale of 0 made every frame NaN (one H200,
    bench.vae_decode). With the floor the frames stay finite and near bf16's; without it (None) they are NaN."""
    monkeypatch.setattr(fastpath, "ZERO_ROW_FLOOR", floor)
    vae = build_component("vae")
    vae.decoder.transformer_blocks.to(torch.bfloat16)  # what fp8 quantises; the rest as dtype = "bfloat16" pins it
    with torch.no_grad():  # block outputs are scaled by scale1/2, zeros as diffusers builds them: give them a say
        for block in vae.decoder.transformer_blocks:
            block.scale1.fill_(1.0), block.scale2.fill_(1.0)
    latents = torch.randn(1, 24, 7, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        bf16 = vae.decode(latents).sample
        fastpath.apply(vae, FastPath(fp8=True))
        fp8 = vae.decode(latents).sample
    quantised = {name for name, m in vae.named_modules() if type(getattr(m, "weight", None)).__name__ == "Float8Tensor"}
    assert quantised and all(name.startswith("decoder.transformer_blocks.") for name in quantised)
    if floor is None:
        assert fp8.isnan().all(), "the zero token's 0/0 reaches every frame"
        return
    assert fp8.isfinite().all()
    assert 0 < (fp8 - bf16).abs().max() < 0.1 * bf16.abs().max()
