"""The encoder and the VAE run once before they say SERVING (a first request otherwise pays the device's set-up):
what they run leaves nothing behind that a request would see, and is no request of anyone's."""

from __future__ import annotations

import torch

from h3serve.runtime.models import ModelSource
from h3serve.services.encoder.runner import COMPONENTS as ENCODER_PARTS
from h3serve.services.encoder.runner import TextEncoderRunner
from h3serve.services.vae.decode import COMPONENTS as VAE_PARTS
from h3serve.services.vae.decode import VaeDecoder
from h3serve.services.vae.tiles import TileDecoder
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
        out = decoder.decode(
            latents,
            audio,
            on_video=lambda done, total: tiles.append(done),
            on_audio=lambda done, total: None,
            on_pixels=chunks.append,
        )
        assert chunks, "the decode streamed its frames"
        return out.frames, out.audio, tiles

    expected = decode(VaeDecoder(parts["vae"], parts["audio_vae"]))
    warmed = VaeDecoder(parts["vae"], parts["audio_vae"])
    warmed.warm_up()
    got = decode(warmed)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert got[2] == expected[2], "tile progress counts this decode's tiles only"


def test_the_vae_warm_up_gives_every_decoder_replica_a_tile():
    # decode_gpus > 1: a replica the warm-up skips pays its GPU's set-up in the first request's decode
    parts = ModelSource(None).load(VAE_PARTS, "cpu", "float32")
    vae = parts["vae"]  # the released tiling (256 px tiles): the 128 px warm-up canvas is one tile
    tiles = TileDecoder(vae, 1, [torch.device("cpu")] * 3)
    calls = [0] * len(tiles.decoders)
    for index, module in enumerate(tiles.decoders):
        module.register_forward_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
    VaeDecoder(vae, parts["audio_vae"], tiles.decoders).warm_up()
    assert all(calls), f"decoder calls per replica: {calls}"


def test_a_vae_warm_up_with_batched_tiles_makes_a_full_call_and_a_call_of_one():
    # a compiled decoder compiles a graph per batch size it meets (a size of 1 is specialised): the warm-up meets both
    parts = ModelSource(None).load(VAE_PARTS, "cpu", "float32")
    tiles = TileDecoder(parts["vae"], 3)
    batches: list[int] = []
    tiles.decoders[0].register_forward_hook(lambda module, args, out: batches.append(out.shape[0]))
    VaeDecoder(parts["vae"], parts["audio_vae"], tiles.decoders).warm_up(tile_batch=3)
    assert 3 in batches and 1 in batches, f"decoder calls' batch sizes: {batches}"
