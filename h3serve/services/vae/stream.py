"""Hand a decode's pixel frames on as each temporal chunk is final, so the muxer encodes while the VAE decodes.

`AutoencoderKLMiniMaxH3._decode` decodes one temporal clip at a time, cross-fades it with the tail of the
previous one and concatenates everything at the end. `frame_chunks` walks the same clips in the same order
with the VAE's own `_decode_clip` and `_blend`, yielding each chunk once no later clip can change it;
`streamed` installs a `_decode` built on it for the length of one decode. Its result is the concatenation
of those chunks, cut to the frames the latents stand for: the very tensor diffusers' loop returns
(tests/test_vae_stream.py compares them for every chunk layout).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

OnFrames = Callable[[torch.Tensor], None]
"""Called with each final chunk of decoder output, (1, C, f, H, W), in order."""


def frame_chunks(vae, z: torch.Tensor) -> Iterator[torch.Tensor]:
    """The decoded frames of latents `z`, chunk by chunk; trailing frames of the end padding included."""
    size, drop = vae.tokens_chunk_size, vae.config.token_drop
    chunk_frames = size * vae.temporal_compression_ratio
    pad = (-(z.shape[2] + drop)) % size  # latent frames repeated to make whole clips
    clips = (z.shape[2] + drop + pad) // size - int(drop > 0)
    if pad:
        z = torch.cat([z, z[:, :, -1:].repeat(1, 1, pad, 1, 1)], dim=2)
    tail = None  # the previous clip's frames that the next one overlaps
    for index in range(clips):
        clip = vae._decode_clip(z[:, :, index * size : (index + 1) * size + vae.token_overlap])
        head = clip[:, :, :chunk_frames][:, :, vae.frame_pre_padding :]
        yield head if tail is None else vae._blend(tail, head, vae.frame_overlap, dim=-3)
        if drop > 0:
            tail = clip[:, :, chunk_frames : 2 * chunk_frames][:, :, vae.frame_pre_padding :]
    if tail is not None:
        yield tail


def _decode_streamed(vae, frames: int, on_frames: OnFrames, z: torch.Tensor) -> torch.Tensor:
    kept, done = [], 0
    for chunk in frame_chunks(vae, z):
        chunk = chunk[:, :, : frames - done]
        if chunk.shape[2]:
            on_frames(chunk)
            kept.append(chunk)
            done += chunk.shape[2]
    return torch.cat(kept, dim=2)


@contextmanager
def streamed(vae, frames: int, on_frames: OnFrames) -> Iterator[None]:
    """While open, `vae.decode` of one latent video of `frames` pixel frames calls `on_frames` per chunk."""
    vae._decode = functools.partial(_decode_streamed, vae, frames, on_frames)
    try:
        yield
    finally:
        del vae._decode  # the class's own method again
