"""The gateway's model-free request rules, checked value by value against diffusers' MiniMax-H3 pipeline."""

import pytest
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    MiniMaxH3ModularPipeline,
    align_num_frames,
    resolve_canvas_size,
    video_latent_num_frames,
)

from h3serve.gateway.admission.request import (
    VALID_NUM_FRAMES,
    InvalidRequest,
    RequestLimits,
    canvas_for_aspect,
    latent_frames,
    resolve,
)
from h3serve.v1 import common_pb2, gateway_pb2
from h3serve.common.config import GatewayConfig

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


def test_accepted_frames_equal_diffusers():
    assert set(VALID_NUM_FRAMES) == {f for f in range(1, 401) if _diffusers_accepts(f)}


def test_refusal_says_where_a_count_rounds():
    assert _refused("num_frames", num_frames=120).endswith("; 120 rounds up to 124")
    assert _refused("num_frames", num_frames=330).endswith("; 330 rounds up to 345")
    assert _refused("num_frames", num_frames=346).endswith("; 346 is above 345")


def test_default_frames():
    assert _resolve().num_frames == 124


def test_latent_frames_match_diffusers():
    for num_frames in VALID_NUM_FRAMES:
        assert latent_frames(num_frames) == video_latent_num_frames(num_frames, FRAMES_PER_CHUNK, LATENTS_PER_CHUNK)
    assert latent_frames(124) == 37
    with pytest.raises(ValueError):
        latent_frames(125)


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


@pytest.mark.parametrize("aspect", [(16, 9), (9, 16), (1, 1), (4, 3), (3, 4), (21, 9), (4, 1), (1, 4), (7, 5)])
def test_canvas_port_equals_diffusers(aspect):
    assert canvas_for_aspect(*aspect) == resolve_canvas_size(*aspect, 32, 768, 1032192)


@pytest.mark.parametrize("height,width", [(768, 1344), (1344, 768), (32, 128), (256, 64), (992, 1024),
                                          (1024, 992)])
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
    assert _resolve().num_inference_steps == 50
    assert _resolve(num_inference_steps=2).num_inference_steps == 2
    assert _resolve(num_inference_steps=200).num_inference_steps == 200
    assert "N-1 denoise steps" in _refused("num_inference_steps", num_inference_steps=1)
    _refused("num_inference_steps", num_inference_steps=201)
    _refused("num_inference_steps", num_inference_steps=-3)


def test_limits_from_config():
    limits = RequestLimits.from_config(GatewayConfig(max_prompt_chars=10, max_steps=8, default_steps=4))
    assert limits == RequestLimits(max_prompt_chars=10, max_steps=8, default_steps=4)
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
    for workflow in (common_pb2.WORKFLOW_FL2VA, common_pb2.WORKFLOW_REF2VA):
        assert _resolve(workflow=workflow).workflow == workflow
    # Unspecified: what the media imply, as diffusers' Auto blocks choose.
    assert _resolve(first_frame="a").workflow == common_pb2.WORKFLOW_FL2VA
    assert _resolve(last_frame="a").workflow == common_pb2.WORKFLOW_FL2VA
    assert _resolve(references=[gateway_pb2.ReferenceInput(asset_id="a")]).workflow == common_pb2.WORKFLOW_REF2VA
    assert "unknown value 7" in _refused("workflow", workflow=7)


def test_seed():
    assert _resolve(seed=1234).seed == 1234
    assert _resolve(seed=0).seed == 0
    drawn = {_resolve().seed for _ in range(2)}
    assert len(drawn) == 2
    assert all(0 <= seed < 2**63 for seed in drawn)


def test_full_resolution():
    request = _resolve(height=512, width=896, num_frames=141, num_inference_steps=8, seed=7, include_raw=True)
    assert request == gateway_pb2.ResolvedRequest(prompt="a fox", height=512, width=896, num_frames=141,
                                                  num_inference_steps=8, seed=7, include_raw=True,
                                                  workflow=common_pb2.WORKFLOW_T2VA)
