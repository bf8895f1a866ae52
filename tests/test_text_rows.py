"""Text rows at submit: whole requests counted by the gateway against diffusers' text encoder steps (tiny model,
in process). The vision-token arithmetic itself is pinned to Qwen3-VL's processors in test_model_rules.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from h3serve.gateway.admission.text_rows import TextCounter, TextRows
from h3serve.model import presets
from h3serve.model.rules import Geometry, VisionGeometry
from h3serve.runtime import tiny
from h3serve.v1 import common_pb2, gateway_pb2, media_pb2


@pytest.fixture(scope="module")
def processor():
    return tiny.build_processor(presets.tiny_tokenizer())


def _text_rows(processor) -> TextRows:
    """The gateway's counter over `processor` (its saved settings, as the gateway reads them)."""
    tokenizer = processor.tokenizer
    vision = VisionGeometry.from_processor_config(
        {"image_processor": processor.image_processor.to_dict(), "video_processor": processor.video_processor.to_dict()}
    )
    return TextRows(
        TextCounter(lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]), vision), GEOMETRY
    )


IMAGE, VIDEO, AUDIO = media_pb2.ASSET_KIND_IMAGE, media_pb2.ASSET_KIND_VIDEO, media_pb2.ASSET_KIND_AUDIO
GEOMETRY = Geometry(canvas_short_edge=64, canvas_max_pixels=64 * 112, reference_image_short_edge=96)


def _encode_in_process(block, processor, tokenizer, **inputs) -> int:
    """Rows of diffusers' text encoder step output for `inputs` (the tiny text encoder, in process)."""
    pipe = block.init_pipeline()
    pipe.update_components(
        text_encoder=tiny.build_text_encoder(tokenizer),
        tokenizer=tokenizer,
        processor=processor,
        **GEOMETRY.pipeline_configs(),
    )
    return len(pipe(**inputs, output="text_token_tags"))


def test_a_ref2va_request_counts_what_diffusers_encodes(processor):
    """A prompt whose NFC form is longer than its bytes, an image, a 3.5 s video with sound at 30 fps, an audio."""
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep

    tokenizer = processor.tokenizer
    prompt = "<Picture 1> क़ <Video 1> to <Audio 2>"  # U+0958: 3 bytes, 6 after the tokenizer's NFC
    assets = {
        "img": gateway_pb2.Asset(asset_id="img", kind=IMAGE, width=50, height=30),
        "vid": gateway_pb2.Asset(
            asset_id="vid",
            kind=VIDEO,
            width=90,
            height=40,
            num_frames=105,
            fps=30.0,
            has_audio=True,
            sample_rate=32000,
            audio_samples=112000,
        ),
        "aud": gateway_pb2.Asset(asset_id="aud", kind=AUDIO, has_audio=True, sample_rate=32000, audio_samples=64000),
    }
    request = gateway_pb2.ResolvedRequest(
        prompt=prompt, height=64, width=96, num_frames=124, workflow=common_pb2.WORKFLOW_REF2VA
    )
    for asset_id in ("vid", "img", "aud"):
        request.references.add(asset_id=asset_id, kind=assets[asset_id].kind, has_audio=assets[asset_id].has_audio)
    references = [
        MiniMaxH3VideoReference(
            frames=np.zeros((105, 40, 90, 3), np.uint8), fps=30.0, audio=torch.zeros(2, 112000), sample_rate=32000
        ),
        MiniMaxH3ImageReference(image=Image.new("RGB", (50, 30))),
        MiniMaxH3AudioReference(audio=torch.zeros(2, 64000), sample_rate=32000),
    ]
    setup = MiniMaxH3Ref2VASetupStep().init_pipeline()
    setup.update_components(**GEOMETRY.pipeline_configs())
    normalized = setup(references=references, height=64, width=96, num_frames=124, output="normalized_references")
    rows = _encode_in_process(
        MiniMaxH3Ref2VATextEncoderStep(), processor, tokenizer, prompt=prompt, normalized_references=normalized
    )
    counted = _text_rows(processor)(request, assets.get)
    assert counted == rows > len(prompt.encode())


@pytest.mark.parametrize("keyframes", [("a",), ("a", "b")])
def test_fl2va_keyframes_count_what_diffusers_encodes(processor, keyframes):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3FL2VATextEncoderStep

    tokenizer = processor.tokenizer
    request = gateway_pb2.ResolvedRequest(
        prompt="<Picture 1> to dusk",
        height=64,
        width=160,
        num_frames=124,
        workflow=common_pb2.WORKFLOW_FL2VA,
        first_frame=keyframes[0],
        last_frame=keyframes[1] if len(keyframes) > 1 else "",
    )
    rows = _encode_in_process(
        MiniMaxH3FL2VATextEncoderStep(),
        processor,
        tokenizer,
        prompt=request.prompt,
        keyframes=[Image.new("RGB", (160, 64))] * len(keyframes),
    )
    counted = _text_rows(processor)(request, {}.get)
    assert counted == rows


def test_the_gateway_does_not_start_without_the_models_tokenizer(tmp_path):
    from h3serve.common.config import GatewayConfig
    from h3serve.gateway.server import _load_text_rows

    with pytest.raises(
        RuntimeError,
        match=r"^\[gateway\] model_dir '.*missing': admission counts text rows with "
        r"the model's tokenizer and processor, which did not load: ",
    ):
        _load_text_rows(GatewayConfig(model_dir=str(tmp_path / "missing")))


@pytest.mark.parametrize("source", ["dir", "random:full"])
def test_the_gateway_reads_the_model_dirs_tokenizer_and_processor_settings(tiny_model_dir, source):
    """From a saved model directory, as from the built-in preset: the same vision geometry and token counts. The
    random:full source (benchmarks) uses the preset's tokenizer and processor."""
    from_dir = TextCounter.load(str(tiny_model_dir) if source == "dir" else source)
    preset = TextCounter.load("")
    assert from_dir.vision == preset.vision
    for text in ("a fox", "<Picture 1>: ", "क़ ünïcode", "<|vision_start|>"):
        assert from_dir.tokens(text) == preset.tokens(text) > 0
