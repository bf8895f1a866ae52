"""h3serve/model/rules.py pinned to diffusers' own MiniMax-H3 functions, value by value over grids of inputs."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    MINIMAX_H3_AUDIO_TAG,
    MINIMAX_H3_TEXT_TAG,
    MINIMAX_H3_VIDEO_TAG,
    MiniMaxH3ModularPipeline,
    align_num_frames,
    audio_latent_num_frames,
    resolve_canvas_size,
    video_latent_num_frames,
)
from PIL import Image

from h3serve.model import presets, rules
from h3serve.model.rules import VALID_NUM_FRAMES, Geometry


def _fact(name):
    # The pipeline's geometry properties fall back to the released checkpoint's values when no component is
    # loaded, so they can be read without an instance.
    return getattr(MiniMaxH3ModularPipeline, name).fget(None)


CHUNK, KEPT = _fact("vae_frames_per_chunk"), _fact("vae_latents_per_chunk")
GEOMETRIES = [
    Geometry(),
    Geometry(canvas_short_edge=64, canvas_max_pixels=64 * 128, reference_image_short_edge=96),
    Geometry(canvas_short_edge=480, canvas_max_pixels=480 * 832, reference_image_short_edge=1024),
]


def test_the_constants_are_the_pipelines():
    assert (rules.FPS, rules.FRAMES_PER_CHUNK, rules.LATENTS_PER_CHUNK) == (_fact("fps"), CHUNK, KEPT)
    assert (rules.MIN_SECONDS, rules.MAX_SECONDS) == (_fact("min_duration"), _fact("max_duration"))
    assert (rules.SAMPLE_RATE, rules.AUDIO_CHANNELS) == (_fact("audio_sampling_rate"), _fact("audio_channels"))
    spatial, patch = _fact("vae_spatial_compression_ratio"), _fact("patch_size")[2]
    assert (rules.VAE_SPATIAL_RATIO, rules.PATCH, rules.CANVAS_MULTIPLE) == (spatial, patch, spatial * patch)
    assert (rules.VIDEO_TAG, rules.TEXT_TAG, rules.AUDIO_TAG) == (
        MINIMAX_H3_VIDEO_TAG,
        MINIMAX_H3_TEXT_TAG,
        MINIMAX_H3_AUDIO_TAG,
    )


def test_valid_frames_are_what_diffusers_generates_unchanged():
    accepted = {
        f
        for f in range(1, 401)
        if align_num_frames(f, CHUNK, KEPT) == f and _fact("min_duration") <= f / rules.FPS <= _fact("max_duration")
    }
    assert set(VALID_NUM_FRAMES) == accepted and VALID_NUM_FRAMES == tuple(range(124, 346, 17))


@pytest.mark.parametrize("frames", range(1, 401))
def test_frame_arithmetic(frames):
    aligned = align_num_frames(frames, CHUNK, KEPT)
    assert rules.align_num_frames(frames) == aligned
    assert rules.latent_frames(aligned) == video_latent_num_frames(aligned, CHUNK, KEPT)
    if aligned > 5:
        assert rules.pixel_frames(rules.latent_frames(aligned)) == aligned
    assert rules.audio_latents(frames) == audio_latent_num_frames(frames)
    if frames >= rules.MIN_REFERENCE_FRAMES:  # the largest 17n+5 <= frames: what the VAE keeps of a reference
        snapped = rules.snap_down(frames)
        assert snapped <= frames < snapped + CHUNK and align_num_frames(snapped, CHUNK, KEPT) == snapped


def test_frames_of_an_invalid_count_are_refused():
    for bad in (125, 0):
        with pytest.raises(ValueError):
            rules.latent_frames(bad)
    for bad in (2, 8):
        with pytest.raises(ValueError):
            rules.pixel_frames(bad)


@pytest.mark.parametrize("seconds", [5, 5.2, 5.5, 7, 9.99, 12.25, 14, 14.375, 14.39])
def test_seconds_round_up_like_diffusers(seconds):
    assert rules.frames_for_seconds(seconds) == align_num_frames(round(seconds * rules.FPS), CHUNK, KEPT)


@pytest.mark.parametrize("seconds", [4.99, 14.4, 15, 60, -5, float("nan"), float("inf")])
def test_seconds_outside_the_range(seconds):
    assert rules.frames_for_seconds(seconds) is None


ASPECTS = sorted(
    {(w, h) for w, h in itertools.product(range(1, 33), repeat=2) if rules.aspect_ok(w, h)}
    | {(1920, 1080), (1080, 1920), (500, 125), (1280, 720), (48, 32), (90, 40), (7, 5)}
)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: str(g.canvas_short_edge))
def test_canvas_for_every_aspect_equals_diffusers(geometry):
    for width, height in ASPECTS:
        expected = resolve_canvas_size(width, height, 32, geometry.canvas_short_edge, geometry.canvas_max_pixels)
        assert geometry.canvas_for_aspect(width, height) == expected, (width, height)
    assert Geometry().default_canvas == resolve_canvas_size(16, 9, 32, 768, 768 * 1344) == (768, 1344)


def _stage_takes(height: int, width: int, geometry: Geometry) -> bool:
    try:
        rules.check_resolved_canvas(height, width, geometry)
        return True
    except rules.InvalidRequest:
        return False


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: str(g.canvas_short_edge))
def test_a_stage_takes_every_canvas_the_gateway_resolves_and_sizes_its_buffers_for_the_largest(geometry):
    """A keyframe's aspect rounds past the area budget (768x1344's by up to 3.6%), so the stages allow one rounding
    step per side; the largest canvas they take is what their input buffers are sized for."""
    resolved = {geometry.canvas_for_aspect(width, height) for width, height in ASPECTS}
    assert max(h * w for h, w in resolved) > geometry.canvas_max_pixels, "the case the rounding step is for"
    requested = {
        (h, w)
        for h, w in itertools.product(range(32, 4097, 32), repeat=2)
        if rules.aspect_ok(w, h) and h * w <= geometry.canvas_max_pixels
    }
    assert all(_stage_takes(h, w, geometry) for h, w in resolved | requested)
    taken = [h * w for h, w in itertools.product(range(32, 8193, 32), repeat=2) if _stage_takes(h, w, geometry)]
    assert rules.largest_resolved_canvas_pixels(geometry) == max(taken) < 1.3 * geometry.canvas_max_pixels
    for height, width, field in (
        (0, 64, "height"),
        (64, -32, "width"),
        (48, 64, "height"),
        (32, 640, "width"),
        (2**31 - 32, 2**31 - 32, "height"),
    ):
        with pytest.raises(rules.InvalidRequest, match=f"^{field}: "):
            rules.check_resolved_canvas(height, width, geometry)


def test_reference_canvases_stay_within_their_largest_sides():
    for geometry in GEOMETRIES:
        image, video = geometry.largest_reference_sides(True), geometry.largest_reference_sides(False)
        for width, height in ASPECTS:
            for canvas, (short, long) in (
                (geometry.image_reference_canvas(width, height), image),
                (geometry.canvas_for_aspect(width, height), video),
            ):
                assert min(canvas) <= short and max(canvas) <= long, (width, height, canvas)


def test_an_aspect_past_4_to_1_is_refused_like_diffusers():
    for width, height in ((5, 1), (1, 5), (401, 100)):
        assert not rules.aspect_ok(width, height)
        with pytest.raises(ValueError):
            resolve_canvas_size(width, height, 32, 768, 768 * 1344)
        with pytest.raises(ValueError):
            Geometry().canvas_for_aspect(width, height)


def _setup(geometry: Geometry):
    pipe = MiniMaxH3Ref2VASetupStep().init_pipeline()
    pipe.update_components(**geometry.pipeline_configs())
    return pipe


def test_image_references_are_resized_like_diffusers():
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3ImageReference

    geometry = Geometry(canvas_short_edge=64, canvas_max_pixels=64 * 128, reference_image_short_edge=96)
    pipe = _setup(geometry)
    for width, height in ((50, 30), (30, 50), (33, 33), (100, 26), (64, 64), (97, 41)):
        out = pipe(
            references=[MiniMaxH3ImageReference(image=Image.new("RGB", (width, height)))],
            height=64,
            width=128,
            num_frames=124,
            output="normalized_references",
        )
        assert out[0].image.size[::-1] == geometry.image_reference_canvas(width, height), (width, height)


@pytest.mark.parametrize("fps", [12.0, 23.976, 24.0, 25.0, 30.0, 60.0])
def test_video_references_are_resampled_and_cut_like_diffusers(fps):
    geometry = Geometry(canvas_short_edge=32, canvas_max_pixels=32 * 64)
    for frames, generated in ((10, 124), (48, 124), (105, 124), (400, 141)):
        normalized = MiniMaxH3Ref2VASetupStep._normalize_video_condition(
            np.zeros((frames, 9, 16, 3), np.uint8),
            fps,
            generated,
            32,
            geometry.canvas_short_edge,
            geometry.canvas_max_pixels,
            24.0,
        )
        assert len(normalized) == rules.reference_video_frames(frames, fps, generated), (frames, generated)
        assert normalized.shape[1:3] == geometry.canvas_for_aspect(16, 9)


@pytest.mark.parametrize("sample_rate", [16000, 32000, 44100, 48000])
def test_soundtrack_rows_follow_the_stages_normalisation(sample_rate):
    """A soundtrack at another rate is resampled to 32 kHz in the stage (PyAV: torchaudio, which diffusers would use,
    is not installed), then diffusers cuts it to the generated length."""
    import torch

    from h3serve.runtime.media import _to_model_rate

    for seconds, generated in ((2.0, 124), (3.3, 124), (9.0, 124), (6.0, 141)):
        samples = int(seconds * sample_rate)
        waveform = torch.zeros(2, samples)
        if sample_rate != rules.SAMPLE_RATE:
            waveform = _to_model_rate(waveform, sample_rate)
        waveform = MiniMaxH3Ref2VASetupStep._normalize_audio_condition(
            waveform, rules.SAMPLE_RATE, rules.SAMPLE_RATE, generated / rules.FPS
        )
        # The audio VAE hops 800 samples at 32 kHz: one latent row per hop, per channel.
        assert rules.soundtrack_rows(samples, sample_rate, generated) == 2 * -(-waveform.shape[-1] // 800), seconds
        assert rules.soundtrack_rows(samples, sample_rate, generated) <= rules.max_soundtrack_rows(generated)


def test_generated_rows_are_the_models_layout():
    # docs/model.md, "Packed rows": t2va at 124 frames is T + 37,710 at 768x1344 and T + 14,844 at 480x832.
    assert rules.generated_rows(768, 1344, 124).total == 37_710
    assert rules.generated_rows(480, 832, 124).total == 14_844
    assert rules.generated_rows(768, 1344, 345) == rules.Rows(video=102 * 1008, audio=1150)


def _vision(processor) -> rules.VisionGeometry:
    """The geometry from a processor's saved settings, as the gateway reads them (no torch there)."""
    return rules.VisionGeometry.from_processor_config(
        {"image_processor": processor.image_processor.to_dict(), "video_processor": processor.video_processor.to_dict()}
    )


@pytest.fixture(scope="module")
def processor():
    from h3serve.runtime import tiny

    return tiny.build_processor(presets.tiny_tokenizer())


@pytest.mark.parametrize(
    "height,width", [(32, 64), (16, 16), (64, 96), (100, 30), (200, 300), (720, 1280), (2048, 3648)]
)
def test_image_tokens_match_the_image_processor(processor, height, width):
    # (16, 16) is under the tiny processor's min pixels, (200, 300) and up over its max: every smart_resize branch.
    grid = processor.image_processor(images=[Image.new("RGB", (width, height))], return_tensors="pt")["image_grid_thw"]
    assert _vision(processor).image_tokens(height, width) == int(grid[0].prod()) // 4


@pytest.mark.parametrize("cap", [False, True])
@pytest.mark.parametrize(
    "frames,height,width", [(2, 32, 64), (3, 64, 32), (11, 32, 64), (12, 768, 1344), (5, 20, 90), (29, 480, 832)]
)
def test_video_block_tokens_match_the_video_processor(processor, frames, height, width, cap):
    video = processor.video_processor
    video.cap_pixels_per_frame = cap
    grid = video(videos=[np.zeros((frames, height, width, 3), np.uint8)], do_sample_frames=False, return_tensors="pt")[
        "video_grid_thw"
    ][0]
    assert int(grid[0]) == len(rules.video_block_timestamps(frames, 2))
    assert _vision(processor).video_block_tokens(frames, height, width) == int(grid[1]) * int(grid[2]) // 4


def test_video_sampling_matches_diffusers():
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep

    for frames in range(22, 346):
        sampled, stamps = MiniMaxH3Ref2VATextEncoderStep._sample_video_condition_frames(
            np.zeros((frames, 1, 1, 3), np.uint8), 24.0, 2.0, 2
        )
        assert (rules.sampled_frames(frames), rules.video_block_timestamps(rules.sampled_frames(frames), 2)) == (
            len(sampled),
            stamps,
        )


def test_the_saved_processor_config_gives_the_loaded_processors_geometry(tmp_path):
    """What the gateway reads from processor_config.json (keys absent there take the classes' defaults) equals the
    geometry of the processor the encoder loads from the same directory, and of the tiny preset's settings."""
    from transformers import Qwen3VLProcessor

    from h3serve.runtime import tiny

    tiny.build_processor(presets.tiny_tokenizer()).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    loaded = Qwen3VLProcessor.from_pretrained(tmp_path)
    assert (
        rules.VisionGeometry.from_processor_config(saved)
        == _vision(loaded)
        == rules.VisionGeometry.from_processor_config(presets.tiny_processor_config())
    )
    assert "cap_pixels_per_frame" not in saved["video_processor"]


def test_stock_qwen3_vl_limits_give_the_models_vision_token_counts():
    """With Qwen3-VL's released processor limits (patch 16, merge 2, 65,536..16,777,216 pixels) a 768x1344 keyframe
    is 1008 vision tokens and a 16:9 image reference at its 2048 short edge (2048x3648) 7296, as the real processor
    says."""
    from types import SimpleNamespace

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    image = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, size={"shortest_edge": 65536, "longest_edge": 16777216}
    )
    vision = _vision(SimpleNamespace(image_processor=image, video_processor=Qwen3VLVideoProcessor()))
    for (height, width), tokens in (((768, 1344), 1008), ((2048, 3648), 7296), ((3648, 2048), 7296)):
        grid = image(images=[Image.new("RGB", (width, height))], return_tensors="pt")["image_grid_thw"][0]
        assert vision.image_tokens(height, width) == int(grid.prod()) // 4 == tokens


def test_prompt_rules():
    assert rules.prompt_tokens_problem(10, 10) is None
    assert rules.prompt_tokens_problem(11, 10) == "at most 10 tokens, got 11 (max_prompt_tokens)"
    assert rules.prompt_problem("a fox", 10) is None
    assert rules.prompt_problem(" \n\t", 10) == "required and must not be blank"
    assert rules.prompt_problem("x" * 11, 10) == "at most 10 characters, got 11"
