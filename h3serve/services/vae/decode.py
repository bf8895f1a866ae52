"""Runs diffusers' MiniMax-H3 decode block (video VAE, then audio VAE) and reports its progress.

The block call itself is the one the in-process pipeline makes, so the output is bit-identical to it;
progress comes from a forward hook on the video decoder, counting the tiles it decodes (known up
front). With `tile_batch > 1` (h3serve/services/vae/tiles.py) one decoder call decodes several tiles, and with
`decode_gpus > 1` replicas of the decoder on other GPUs decode shares of them.
Each temporal chunk's uint8 pixels can be handed on as soon as it is final (stream.py), for the muxer.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3DecodeStep
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MINIMAX_H3_AUDIO_CHANNELS

from h3serve.model import rules
from h3serve.services.vae.mux import LandingFrames, handed_over
from h3serve.services.vae.stream import streamed

COMPONENTS = ["vae", "audio_vae"]
WARMUP_FRAMES, WARMUP_LATENT_SIDE = 22, 8  # the warm-up decode: one clip (7 latent frames) of 8 x 8 latents or wider

Progress = Callable[[int, int], None]
"""Called with (units done, units in the phase); it may raise to stop the decode."""

OnPixels = Callable[[np.ndarray | LandingFrames], None]
"""Called with each final chunk of the video as uint8 levels (f, H, W, 3) on the CPU, in order (from a GPU, still
landing: `LandingFrames.numpy` waits for them)."""


class InvalidLatents(ValueError):
    """Latents that the decode block cannot turn into a MiniMax-H3 video and soundtrack."""


@dataclass(frozen=True)
class DecodePlan:
    """What decoding one pair of latents produces and costs, known before anything runs."""

    frames: int
    height: int
    width: int
    channels: int
    audio_channels: int
    audio_samples: int
    sample_rate: int
    decoder_tiles: int  # what the video decoder decodes: temporal chunks x spatial tiles

    @property
    def raw_bytes(self) -> int:
        """float32 bytes of the frames (F, H, W, C) plus the audio (channels, S)."""
        return 4 * (self.frames * self.height * self.width * self.channels + self.audio_channels * self.audio_samples)


@dataclass(frozen=True)
class Decoded:
    """The block's output, left on the VAE's device."""

    frames: torch.Tensor  # (F, H, W, 3) float32 in [0, 1]: a channels-last view of the block's (F, 3, H, W)
    audio: torch.Tensor  # (channels, S) float32
    sample_rate: int


def pixel_geometry(vae, latents_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(frames, height, width) that `vae` decodes latents (1, C, 5n+2, h, w) into: 17n+5 frames of 16h x 16w.

    The numbers come from the VAE's chunking: each of the n clips yields `clip_length` frames, and the
    trailing latent frames that survived `token_drop` yield the rest.
    """
    num_latent_frames, latent_height, latent_width = latents_shape[2:]
    kept = vae.tokens_chunk_size - vae.config.token_drop
    clips, rest = divmod(num_latent_frames - kept, vae.tokens_chunk_size)
    if rest or clips < 1:
        raise InvalidLatents(
            f"latents: {num_latent_frames} latent frames, expected {vae.tokens_chunk_size} * n + {kept} with n >= 1"
        )
    frames = vae.config.clip_length * clips + kept * vae.temporal_compression_ratio - vae.frame_pre_padding
    ratio = vae.spatial_compression_ratio
    return frames, latent_height * ratio, latent_width * ratio


def decoder_tiles(vae, latents_shape: tuple[int, ...]) -> int:
    """How many inputs `AutoencoderKLMiniMaxH3._decode` gives `vae.decoder` for one latent video: one
    per temporal chunk and, with tiling on, per spatial tile of `_decode_clip`."""
    num_latent_frames, latent_height, latent_width = latents_shape[2:]
    token_drop = vae.config.token_drop
    chunks = math.ceil((num_latent_frames + token_drop) / vae.tokens_chunk_size) - int(token_drop > 0)
    return chunks * spatial_tiles(vae, latent_height, latent_width)


def spatial_tiles(vae, latent_height: int, latent_width: int) -> int:
    """How many tiles `_decode_clip` cuts one latent clip of that canvas into (1 with tiling off)."""
    if not vae.use_tiling:
        return 1
    ratio = vae.spatial_compression_ratio
    rows = vae._split_tiles(latent_height * ratio, vae.tile_sample_min_height, vae.tile_sample_min_overlap_height)
    cols = vae._split_tiles(latent_width * ratio, vae.tile_sample_min_width, vae.tile_sample_min_overlap_width)
    return len(rows[0]) * len(cols[0])


def _check_shape(name: str, shape: tuple[int, ...], expected: tuple[int | None, ...]) -> None:
    """`expected` holds the required size per dimension, None where any positive size will do."""
    if len(shape) != len(expected) or any(
        s < 1 or (e is not None and s != e) for s, e in zip(shape, expected, strict=True)
    ):
        wanted = ", ".join("*" if e is None else str(e) for e in expected)
        raise InvalidLatents(f"{name}: shape {list(shape)}, expected [{wanted}]")


@contextmanager
def _tiles_reported(decoders: list[torch.nn.Module], total: int, on_call: Progress) -> Iterator[None]:
    """Report every forward of the video decoders (one per GPU the tiles spread over) as (tiles so far, total)
    while the block runs."""
    done, lock = 0, threading.Lock()

    def hook(module, args, output) -> None:
        nonlocal done
        with lock:  # replicas decode on threads of their own
            done += output.shape[0]  # a batch of tiles (latents are one video)
            on_call(done, total)

    handles = [decoder.register_forward_hook(hook) for decoder in decoders]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class VaeDecoder:
    """The decode block over one video VAE and one audio VAE. Not re-entrant: callers serialize."""

    def __init__(self, vae, audio_vae, decoders: list[torch.nn.Module] | None = None) -> None:
        self.vae, self.audio_vae = vae, audio_vae
        self.decoders = decoders or [vae.decoder]  # TileDecoder.decoders when tiles spread over GPUs
        self.pipe = MiniMaxH3DecodeStep().init_pipeline()
        self.pipe.update_components(vae=vae, audio_vae=audio_vae)

    def plan(self, latents: torch.Tensor, audio_latents: torch.Tensor) -> DecodePlan:
        """Check the latents (float32 (1, C, 5n+2, h, w) and (2, C_audio, A)) and size the output."""
        for name, tensor in (("latents", latents), ("audio_latents", audio_latents)):
            if tensor.dtype != torch.float32:
                raise InvalidLatents(f"{name}: dtype {tensor.dtype}, expected torch.float32")
        _check_shape("latents", tuple(latents.shape), (1, self.vae.config.latent_channels, None, None, None))
        _check_shape(
            "audio_latents",
            tuple(audio_latents.shape),
            (MINIMAX_H3_AUDIO_CHANNELS, self.audio_vae.config.latent_channels, None),
        )
        frames, height, width = pixel_geometry(self.vae, latents.shape)
        return DecodePlan(
            frames=frames,
            height=height,
            width=width,
            channels=self.vae.config.out_channels,
            audio_channels=MINIMAX_H3_AUDIO_CHANNELS,
            audio_samples=audio_latents.shape[-1] * self.audio_vae.hop_length,
            sample_rate=self.pipe.audio_sampling_rate,
            decoder_tiles=decoder_tiles(self.vae, latents.shape),
        )

    def decode(
        self,
        latents: torch.Tensor,
        audio_latents: torch.Tensor,
        on_video: Progress,
        on_audio: Progress,
        on_pixels: OnPixels | None = None,
    ) -> Decoded:
        plan = self.plan(latents, audio_latents)
        device = self.vae.device
        with (
            _tiles_reported(self.decoders, plan.decoder_tiles, on_video),
            streamed(self.vae, plan.frames, self._pixels_to(on_pixels, device)),
        ):
            # "pt" holds the very floats "np" would copy to the CPU, channels first (VideoProcessor.postprocess)
            out = self.pipe(
                latents=latents.to(device),
                audio_latents=audio_latents.to(device),
                output_type="pt",
                output=["videos", "audio", "sampling_rate"],
            )
        on_audio(1, 1)  # the block runs the audio VAE after the last video-decoder call
        return Decoded(
            frames=out["videos"][0].permute(0, 2, 3, 1), audio=out["audio"][0], sample_rate=int(out["sampling_rate"])
        )

    def warm_up(self, tile_batch: int = 1) -> None:
        """Decode one clip of zeros at a small canvas before the service serves: a process's first decode pays the
        device's one-time set-up (on one H200 the first request's decode took 3.29-3.30 s, later ones 2.70-2.80 s at
        480x832x124). The canvas is widened until every decoder replica gets a tile: each GPU pays its own set-up;
        with `tile_batch` > 1 tiles per call, until each gets a full call and a call of one tile: a compiled decoder
        compiles a graph for each (torch specialises a size of 1), before a request instead of in it."""
        side = width = WARMUP_LATENT_SIDE
        per_replica = tile_batch + 1 if tile_batch > 1 else 1
        while self.vae.use_tiling and spatial_tiles(self.vae, side, width) < per_replica * len(self.decoders):
            width += side
        latents = torch.zeros(1, self.vae.config.latent_channels, rules.latent_frames(WARMUP_FRAMES), side, width)
        audio = torch.zeros(
            MINIMAX_H3_AUDIO_CHANNELS, self.audio_vae.config.latent_channels, rules.audio_latents(WARMUP_FRAMES)
        )
        self.decode(latents, audio, on_video=_ignored, on_audio=_ignored)

    def _pixels_to(self, on_pixels: OnPixels | None, device: torch.device) -> Callable[[torch.Tensor], None]:
        """Decoder output chunks -> `on_pixels`, through the block's own pixel arithmetic (elementwise, so a
        chunk's levels are those of the same frames of the whole video)."""
        if on_pixels is None:
            return lambda chunk: None
        mean = torch.tensor(self.pipe.pixel_mean, device=device).view(1, -1, 1, 1, 1)
        std = torch.tensor(self.pipe.pixel_std, device=device).view(1, -1, 1, 1, 1)
        return lambda chunk: on_pixels(handed_over((chunk.float() * std + mean).clamp(0, 1)[0].permute(1, 2, 3, 0)))


def _ignored(done: int, total: int) -> None:
    """The warm-up decode's progress: nobody asked for it."""
