"""Text rows at submit: the processor arithmetic against Qwen3-VL's real processors and diffusers' own
presentation code, and whole requests against diffusers' text encoder steps (tiny model, in process)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from h3serve.gateway.admission.text_rows import TextRows, VisionGeometry, sampled_frames, video_block_timestamps
from h3serve.v1 import common_pb2, gateway_pb2, media_pb2
from h3serve.runtime import tiny
from h3serve.common.config import ModelGeometry


@pytest.fixture(scope="module")
def processor():
    return tiny.build_processor(tiny.build_tokenizer())


@pytest.mark.parametrize("height,width", [(32, 64), (16, 16), (64, 96), (100, 30), (200, 300), (720, 1280),
                                          (2048, 3648)])
def test_image_tokens_match_the_image_processor(processor, height, width):
    # (16, 16) is under the tiny processor's min pixels, (200, 300) and up over its max: every smart_resize branch.
    vision = VisionGeometry.of(processor)
    grid = processor.image_processor(images=[Image.new("RGB", (width, height))], return_tensors="pt")["image_grid_thw"]
    assert vision.image_tokens(height, width) == int(grid[0].prod()) // 4


@pytest.mark.parametrize("cap", [False, True])
@pytest.mark.parametrize("frames,height,width", [(2, 32, 64), (3, 64, 32), (11, 32, 64), (12, 768, 1344),
                                                 (5, 20, 90), (29, 480, 832)])
def test_video_block_tokens_match_the_video_processor(processor, frames, height, width, cap):
    video = processor.video_processor
    video.cap_pixels_per_frame = cap
    grid = video(videos=[np.zeros((frames, height, width, 3), np.uint8)], do_sample_frames=False,
                 return_tensors="pt")["video_grid_thw"][0]
    vision = VisionGeometry.of(processor)
    assert int(grid[0]) == len(video_block_timestamps(frames, 2))
    assert vision.video_block_tokens(frames, height, width) == int(grid[1]) * int(grid[2]) // 4


def test_video_sampling_matches_diffusers():
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep

    for frames in range(22, 346):
        sampled, stamps = MiniMaxH3Ref2VATextEncoderStep._sample_video_condition_frames(
            np.zeros((frames, 1, 1, 3), np.uint8), 24.0, 2.0, 2)
        assert (sampled_frames(frames), video_block_timestamps(sampled_frames(frames), 2)) == (len(sampled), stamps)


IMAGE, VIDEO, AUDIO = media_pb2.ASSET_KIND_IMAGE, media_pb2.ASSET_KIND_VIDEO, media_pb2.ASSET_KIND_AUDIO
GEOMETRY = ModelGeometry(canvas_short_edge=64, canvas_max_pixels=64 * 112, reference_image_short_edge=96)


def _encode_in_process(block, processor, tokenizer, **inputs) -> int:
    """Rows of diffusers' text encoder step output for `inputs` (the tiny text encoder, in process)."""
    pipe = block.init_pipeline()
    pipe.update_components(text_encoder=tiny.build_text_encoder(tokenizer), tokenizer=tokenizer, processor=processor,
                           **GEOMETRY.pipeline_configs())
    return len(pipe(**inputs, output="text_token_tags"))


def test_a_ref2va_request_counts_what_diffusers_encodes(processor):
    """A prompt whose NFC form is longer than its bytes, an image, a 3.5 s video with sound at 30 fps, an audio."""
    from diffusers.modular_pipelines.minimax_h3 import (MiniMaxH3AudioReference, MiniMaxH3ImageReference,
                                                         MiniMaxH3VideoReference)
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep

    tokenizer = processor.tokenizer
    prompt = "<Picture 1> क़ <Video 1> to <Audio 2>"  # U+0958: 3 bytes, 6 after the tokenizer's NFC
    assets = {"img": gateway_pb2.Asset(asset_id="img", kind=IMAGE, width=50, height=30),
              "vid": gateway_pb2.Asset(asset_id="vid", kind=VIDEO, width=90, height=40, num_frames=105, fps=30.0,
                                       has_audio=True, sample_rate=32000, audio_samples=112000),
              "aud": gateway_pb2.Asset(asset_id="aud", kind=AUDIO, has_audio=True, sample_rate=32000,
                                       audio_samples=64000)}
    request = gateway_pb2.ResolvedRequest(prompt=prompt, height=64, width=96, num_frames=124,
                                          workflow=common_pb2.WORKFLOW_REF2VA)
    for asset_id in ("vid", "img", "aud"):
        request.references.add(asset_id=asset_id, kind=assets[asset_id].kind, has_audio=assets[asset_id].has_audio)
    references = [
        MiniMaxH3VideoReference(frames=np.zeros((105, 40, 90, 3), np.uint8), fps=30.0, audio=torch.zeros(2, 112000),
                                sample_rate=32000),
        MiniMaxH3ImageReference(image=Image.new("RGB", (50, 30))),
        MiniMaxH3AudioReference(audio=torch.zeros(2, 64000), sample_rate=32000)]
    setup = MiniMaxH3Ref2VASetupStep().init_pipeline()
    setup.update_components(**GEOMETRY.pipeline_configs())
    normalized = setup(references=references, height=64, width=96, num_frames=124, output="normalized_references")
    rows = _encode_in_process(MiniMaxH3Ref2VATextEncoderStep(), processor, tokenizer, prompt=prompt,
                              normalized_references=normalized)
    counted = TextRows(lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]),
                       VisionGeometry.of(processor), GEOMETRY)(request, assets)
    assert counted == rows > len(prompt.encode())


@pytest.mark.parametrize("keyframes", [("a",), ("a", "b")])
def test_fl2va_keyframes_count_what_diffusers_encodes(processor, keyframes):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3FL2VATextEncoderStep

    tokenizer = processor.tokenizer
    request = gateway_pb2.ResolvedRequest(prompt="<Picture 1> to dusk", height=64, width=160, num_frames=124,
                                          workflow=common_pb2.WORKFLOW_FL2VA, first_frame=keyframes[0],
                                          last_frame=keyframes[1] if len(keyframes) > 1 else "")
    rows = _encode_in_process(MiniMaxH3FL2VATextEncoderStep(), processor, tokenizer, prompt=request.prompt,
                              keyframes=[Image.new("RGB", (160, 64))] * len(keyframes))
    counted = TextRows(lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]),
                       VisionGeometry.of(processor), GEOMETRY)(request, {})
    assert counted == rows


def test_stock_qwen3_vl_limits_give_the_models_vision_token_counts():
    """With Qwen3-VL's released processor limits (patch 16, merge 2, 65,536..16,777,216 pixels) a 768x1344 keyframe
    is 1008 vision tokens and a 16:9 image reference at its 2048 short edge (2048x3648) 7296, as the real processor
    says."""
    from types import SimpleNamespace

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    image = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, size={"shortest_edge": 65536,
                                                                        "longest_edge": 16777216})
    vision = VisionGeometry.of(SimpleNamespace(image_processor=image, video_processor=Qwen3VLVideoProcessor()))
    for (height, width), tokens in (((768, 1344), 1008), ((2048, 3648), 7296), ((3648, 2048), 7296)):
        grid = image(images=[Image.new("RGB", (width, height))], return_tensors="pt")["image_grid_thw"][0]
        assert vision.image_tokens(height, width) == int(grid.prod()) // 4 == tokens


def test_the_gateway_does_not_start_without_the_models_tokenizer(tmp_path):
    from h3serve.gateway.server import _load_text_rows
    from h3serve.common.config import GatewayConfig

    with pytest.raises(RuntimeError, match=r"^\[gateway\] model_dir '.*missing': admission counts text rows with "
                                           r"the model's tokenizer and processor, which did not load: "):
        _load_text_rows(GatewayConfig(model_dir=str(tmp_path / "missing")))
