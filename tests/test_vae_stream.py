"""Decoded frames handed on chunk by chunk are the frames diffusers' own temporal loop returns, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3

from h3serve.model.presets import TINY_VAE
from h3serve.runtime.tiny import build_component
from h3serve.services.vae.decode import VaeDecoder, pixel_geometry
from h3serve.services.vae.mux import Muxer, to_uint8
from h3serve.services.vae.stream import frame_chunks, streamed


def tiny_vae(**changes) -> AutoencoderKLMiniMaxH3:
    torch.manual_seed(0)
    return AutoencoderKLMiniMaxH3(**{**TINY_VAE, **changes}).eval()


def latents(frames: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, 24, frames, 2, 3, generator=torch.Generator().manual_seed(seed))


# token_drop 3 is the released layout (consecutive clips cross-fade); 0 has no overlap; 1 a one-token one.
# Frame counts cover one clip, several, and lengths that need end padding (what diffusers cuts off again).
@pytest.mark.parametrize("token_drop", [3, 0, 1])
@pytest.mark.parametrize("latent_frames", [7, 12, 9, 10, 17])
def test_chunks_concatenate_to_what_diffusers_decodes(token_drop, latent_frames):
    vae = tiny_vae(token_drop=token_drop)
    z = latents(latent_frames)
    with torch.no_grad():
        expected = vae._decode(z)
        chunks = list(frame_chunks(vae, z))
    assert len(chunks) > 1
    joined = torch.cat(chunks, dim=2)
    assert joined.shape[2] >= expected.shape[2]  # the end padding's frames are still there
    assert torch.equal(joined[:, :, : expected.shape[2]], expected)


def test_streamed_decode_hands_every_frame_on_once_and_returns_the_same_tensor():
    vae = tiny_vae()
    z = latents(12)
    frames = pixel_geometry(vae, z.shape)[0]
    handed = []
    with torch.no_grad():
        expected = vae.decode(z).sample
        with streamed(vae, frames, handed.append):
            decoded = vae.decode(z).sample
        assert "_decode" not in vars(vae)  # the class's method again
        assert torch.equal(vae.decode(z).sample, expected)
    assert torch.equal(decoded, expected)
    assert [chunk.shape[2] for chunk in handed] == [17, 17, 5]  # a chunk per clip, then the last clip's tail
    assert torch.equal(torch.cat(handed, dim=2), expected)


def test_pixels_arrive_while_the_decoder_still_runs_and_equal_the_blocks_levels():
    vae, audio_vae = build_component("vae"), build_component("audio_vae")
    z, audio = latents(17, seed=1), torch.randn(2, 32, 6, generator=torch.Generator().manual_seed(2))
    log: list[tuple[str, int]] = []
    pixels: list[np.ndarray] = []

    def on_pixels(levels: np.ndarray) -> None:
        log.append(("pixels", len(levels)))
        pixels.append(levels)

    decoded = VaeDecoder(vae, audio_vae).decode(
        z,
        audio,
        on_video=lambda done, total: log.append(("video", done)),
        on_audio=lambda *_: None,
        on_pixels=on_pixels,
    )
    # Each clip's frames are handed on before the next clip is decoded; the last clip also frees the tail.
    assert log == [
        ("video", 1),
        ("pixels", 17),
        ("video", 2),
        ("pixels", 17),
        ("video", 3),
        ("pixels", 17),
        ("pixels", 5),
    ]
    assert all(chunk.dtype == np.uint8 for chunk in pixels)
    assert np.array_equal(np.concatenate(pixels), to_uint8(decoded.frames))


def frames(count: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (count, 16, 16, 3), dtype=np.uint8)


def test_a_muxer_failure_reaches_the_decode_and_the_file_is_dropped():
    class Gone(Exception):
        pass

    def progress(done: int, total: int) -> None:
        raise Gone(f"client left at second {done} of {total}")

    with pytest.raises(Gone, match="client left at second 1 of 2"):
        with Muxer(48, 16, 16, 32000, 2, progress) as muxer:
            muxer.add(frames(24))
            muxer.add(frames(24))
            muxer.finish(np.zeros((2, 64000), np.float32))


def test_a_muxer_refuses_an_mp4_with_frames_missing():
    with pytest.raises(ValueError, match="the muxer got 24 frames, expected 48"):
        with Muxer(48, 16, 16, 32000, 2, lambda *_: None) as muxer:
            muxer.add(frames(24))
            muxer.finish(np.zeros((2, 64000), np.float32))
