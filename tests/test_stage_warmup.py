"""The encoder and the VAE run once before they say SERVING (a first request otherwise pays the device's set-up):
what they run leaves nothing behind that a request would see, and is no request of anyone's."""

from __future__ import annotations

import torch

from h3serve.runtime.models import ModelSource
from h3serve.services.encoder.runner import COMPONENTS as ENCODER_PARTS
from h3serve.services.encoder.runner import TextEncoderRunner
from h3serve.services.vae.decode import COMPONENTS as VAE_PARTS
from h3serve.services.vae.decode import VaeDecoder
from h3serve.v1 import common_pb2

PROMPT = "a heron lands on a jetty while rain starts"


def test_the_encoder_warm_up_is_not_counted_and_changes_no_embedding():
    parts = ModelSource(None).load(ENCODER_PARTS, "cpu", "float32")
    expected = TextEncoderRunner(parts).encode(PROMPT, common_pb2.WORKFLOW_T2VA)
    warmed = TextEncoderRunner(parts)
    warmed.warm_up()
    assert warmed.runs == 0, "Info's model_runs counts requests' encodes"
    got = warmed.encode(PROMPT, common_pb2.WORKFLOW_T2VA)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_the_vae_warm_up_leaves_the_next_decode_bit_identical_and_hands_on_no_pixels():
    parts = ModelSource(None).load(VAE_PARTS, "cpu", "float32")
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, parts["vae"].config.latent_channels, 7, 2, 4, generator=generator)
    audio = torch.randn(2, parts["audio_vae"].config.latent_channels, 37, generator=generator)

    def decode(decoder: VaeDecoder) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        chunks, tiles = [], []
        out = decoder.decode(latents, audio, on_video=lambda done, total: tiles.append(done),
                             on_audio=lambda done, total: None, on_pixels=chunks.append)
        assert chunks, "the decode streamed its frames"
        return out.frames, out.audio, tiles

    expected = decode(VaeDecoder(parts["vae"], parts["audio_vae"]))
    warmed = VaeDecoder(parts["vae"], parts["audio_vae"])
    warmed.warm_up()
    got = decode(warmed)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert got[2] == expected[2], "tile progress counts this decode's tiles only"
