"""Request resolution at the gateway: every field of a t2va request, each refusal naming its field; the rules
themselves are pinned to diffusers in test_model_rules.py."""

import pytest
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    MiniMaxH3ModularPipeline,
    align_num_frames,
    resolve_canvas_size,
)

from h3serve.common.config import GatewayConfig
from h3serve.gateway.admission.request import RequestLimits, resolve
from h3serve.model.rules import VALID_NUM_FRAMES, Geometry, InvalidRequest
from h3serve.v1 import common_pb2, gateway_pb2

LIMITS = RequestLimits()


def _fact(name):
    # The pipeline's geometry properties fall back to the released checkpoint's values when no component is
    # loaded, so they can be read without an instance.
    return getattr(MiniMaxH3ModularPipeline, name).fget(None)


FPS = _fact("fps")
FRAMES_PER_CHUNK, LATENTS_PER_CHUNK = _fact("vae_frames_per_chunk"), _fact("vae_latents_per_chunk")


def _resolve(**fields):
    return resolve(gateway_pb2.GenerateRequest(**{"prompt": "a fox", **fields}), LIMITS)


def _refused(field, **fields):
    with pytest.raises(InvalidRequest) as caught:
        _resolve(**fields)
    assert caught.value.field == field
    assert str(caught.value) == caught.value.message
    assert caught.value.message.startswith(f"{field}: ")
    return caught.value.message


def _diffusers_accepts(num_frames):
    """What diffusers generates unchanged: aligned already, and within its duration limits."""
    aligned = align_num_frames(num_frames, FRAMES_PER_CHUNK, LATENTS_PER_CHUNK)
    return aligned == num_frames and _fact("min_duration") <= aligned / FPS <= _fact("max_duration")


# Frames.


def test_valid_frames_are_the_14_counts_from_124_to_345():
    assert VALID_NUM_FRAMES == tuple(range(124, 346, 17))


@pytest.mark.parametrize("num_frames", range(1, 401))
def test_every_frame_count(num_frames):
    if num_frames in VALID_NUM_FRAMES:
        assert _resolve(num_frames=num_frames).num_frames == num_frames
    else:
        message = _refused("num_frames", num_frames=num_frames)
        assert "124, 141, 158, 175, 192, 209, 226, 243, 260, 277, 294, 311, 328, 345" in message


def test_refusal_says_where_a_count_rounds():
    assert _refused("num_frames", num_frames=120).endswith("; 120 rounds up to 124")
    assert _refused("num_frames", num_frames=330).endswith("; 330 rounds up to 345")
    assert _refused("num_frames", num_frames=346).endswith("; 346 is above 345")


def test_default_frames():
    assert _resolve().num_frames == 124


# Seconds.


@pytest.mark.parametrize("seconds", [5, 5.2, 5.5, 7, 9.99, 12.25, 14, 14.375, 14.39])
def test_seconds_round_up_like_diffusers(seconds):
    frames = _resolve(seconds=seconds).num_frames
    assert frames == align_num_frames(round(seconds * FPS), FRAMES_PER_CHUNK, LATENTS_PER_CHUNK)
    assert frames in VALID_NUM_FRAMES


def test_seconds_examples():
    assert _resolve(seconds=5).num_frames == 124
    assert _resolve(seconds=5.5).num_frames == 141  # 132 -> 141
    assert _resolve(seconds=14.375).num_frames == 345


@pytest.mark.parametrize("seconds", [4.99, 14.4, 15, 15.01, 60, -5, float("nan"), float("inf")])
def test_seconds_out_of_range(seconds):
    message = _refused("seconds", seconds=seconds)
    assert "between 5 and 14.375 (345 frames" in message


def test_frames_and_seconds_together():
    assert "seconds" in _refused("num_frames", num_frames=124, seconds=5)


# Canvas.


def test_default_canvas_equals_diffusers():
    expected = resolve_canvas_size(16, 9, 32, 768, 1032192)
    assert expected == (768, 1344)
    request = _resolve()
    assert (request.height, request.width) == expected


def test_a_deployment_geometry_sets_the_default_canvas_and_the_area_bound():
    tiny = RequestLimits(geometry=Geometry(canvas_short_edge=64, canvas_max_pixels=64 * 128))
    request = resolve(gateway_pb2.GenerateRequest(prompt="a fox"), tiny)
    assert (request.height, request.width) == resolve_canvas_size(16, 9, 32, 64, 64 * 128) == (64, 128)
    with pytest.raises(InvalidRequest, match="^height: height\\*width must be at most 8,192 pixels"):
        resolve(gateway_pb2.GenerateRequest(prompt="a fox", height=96, width=128), tiny)


@pytest.mark.parametrize("height,width", [(768, 1344), (1344, 768), (32, 128), (256, 64), (992, 1024), (1024, 992)])
def test_canvas_accepted(height, width):
    request = _resolve(height=height, width=width)
    assert (request.height, request.width) == (height, width)


def test_canvas_not_multiple_of_32():
    assert _refused("height", height=40, width=768) == "height: must be a positive multiple of 32, got 40"
    _refused("width", height=768, width=1000)
    _refused("width", height=768, width=-32)


def test_canvas_one_missing():
    assert "height and width go together" in _refused("width", height=768)
    assert "height and width go together" in _refused("height", width=768)


def test_canvas_aspect():
    assert "1:4 and 4:1" in _refused("width", height=256, width=1280)  # 5:1
    _refused("height", height=1280, width=256)  # 1:5


def test_canvas_area():
    assert "1,032,192" in _refused("height", height=1024, width=1280)
    _refused("height", height=1024, width=1024)  # 1,048,576: just over


# Steps.


def test_steps():
    assert _resolve().params.num_inference_steps == 50
    assert _resolve(params=common_pb2.GenerationParams(num_inference_steps=2)).params.num_inference_steps == 2
    assert _resolve(num_inference_steps=200).params.num_inference_steps == 200
    assert "N-1 denoise steps" in _refused("num_inference_steps", num_inference_steps=1)
    _refused("num_inference_steps", num_inference_steps=201)
    _refused("num_inference_steps", num_inference_steps=-3)


def test_limits_from_config():
    limits = RequestLimits.from_config(GatewayConfig(max_prompt_chars=10, max_steps=8, default_steps=4))
    assert limits == RequestLimits(max_prompt_chars=10, max_steps=8, default_steps=4, geometry=Geometry())
    with pytest.raises(InvalidRequest, match="num_inference_steps"):
        resolve(gateway_pb2.GenerateRequest(prompt="a", num_inference_steps=9), limits)
    with pytest.raises(ValueError):
        RequestLimits(max_steps=8, default_steps=50)


# Prompt, workflow, seed, include_raw.


def test_prompt():
    _refused("prompt", prompt="")
    _refused("prompt", prompt=" \n\t ")
    assert "at most 8192 characters, got 8193" in _refused("prompt", prompt="x" * 8193)
    assert _resolve(prompt="é" * 8192).prompt == "é" * 8192
    assert _resolve(prompt="  a fox \n").prompt == "  a fox \n"


def test_workflow():
    assert _resolve().workflow == common_pb2.WORKFLOW_T2VA
    assert _resolve(workflow=common_pb2.WORKFLOW_T2VA).workflow == common_pb2.WORKFLOW_T2VA
    assert "unknown value 7; one of T2VA, FL2VA, REF2VA" in _refused("workflow", workflow=7)
    assert "fl2va needs a first_frame" in _refused("first_frame", workflow=common_pb2.WORKFLOW_FL2VA)
    assert "ref2va needs at least one reference" in _refused("references", workflow=common_pb2.WORKFLOW_REF2VA)


def test_seed():
    assert _resolve(seed=1234).params.seed == 1234
    assert _resolve(params=common_pb2.GenerationParams(seed=0)).params.seed == 0
    drawn = {_resolve().params.seed for _ in range(2)}
    assert len(drawn) == 2
    assert all(0 <= seed < 2**63 for seed in drawn)


def test_full_resolution():
    params = common_pb2.GenerationParams(num_inference_steps=8, seed=7, include_raw=True)
    request = _resolve(height=512, width=896, num_frames=141, params=params)
    # The deprecated top-level copies are kept filled for clients from before params; the shifts are the released
    # model's, as no adapter recommends others.
    params.flow_shift, params.audio_flow_shift = 12.0, 3.0
    assert request == gateway_pb2.ResolvedRequest(
        prompt="a fox",
        height=512,
        width=896,
        num_frames=141,
        params=params,
        num_inference_steps=8,
        seed=7,
        include_raw=True,
        workflow=common_pb2.WORKFLOW_T2VA,
    )


def test_the_deprecated_top_level_options_fold_into_params():
    legacy = _resolve(num_inference_steps=8, seed=7, include_raw=True)
    assert legacy.params == common_pb2.GenerationParams(
        num_inference_steps=8, seed=7, include_raw=True, flow_shift=12.0, audio_flow_shift=3.0
    )
    agreeing = _resolve(num_inference_steps=8, params=common_pb2.GenerationParams(num_inference_steps=8, seed=3))
    assert (agreeing.params.num_inference_steps, agreeing.params.seed) == (8, 3)
    message = _refused(
        "num_inference_steps", num_inference_steps=8, params=common_pb2.GenerationParams(num_inference_steps=9)
    )
    assert (
        message
        == "num_inference_steps: set at the top level (8) and in params (9); set params.num_inference_steps only"
    )
    _refused("seed", seed=1, params=common_pb2.GenerationParams(seed=2))
