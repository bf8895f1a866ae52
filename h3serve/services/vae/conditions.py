"""Keyframes and references to conditioning latents: the workflow's own VAE-encode block, asset by asset.

The block runs once per keyframe or reference, which is bit-identical to one call over all of them:
every visual condition samples its posterior under its own fresh seed-42 generator, and soundtracks
take the posterior mode. Progress counts encoder calls, known before the first one: each video-encoder
input (temporal clips x spatial tiles of every keyframe, image and video reference) and each soundtrack's
audio-encoder call, counted by forward hooks on both encoders.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers.modular_pipelines.minimax_h3 import (
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3VideoReference,
)
from PIL import Image

from h3serve.model import rules, workflows
from h3serve.model.workflows.base import PreparedMedia

Progress = Callable[[int, int], None]
"""Called with (encoder calls done, encoder calls in the request); it may raise to stop the encode."""


@dataclass
class Conditions:
    tensors: dict[str, torch.Tensor]  # "condition_latents.<i>", "audio_condition_latents.<j>"
    manifest: dict  # the DenoiseSpec fields the DiT needs with them


def encoder_calls(vae, frames: int, height: int, width: int) -> int:
    """How many inputs `AutoencoderKLMiniMaxH3._encode` gives `vae.encoder` for one (1, 3, frames, height, width)
    video: one per `clip_length`-frame clip (a single frame is one, not padded to a clip) and, with tiling on, per
    spatial tile of `_encode_clip`."""
    clips = 1 if frames == 1 else math.ceil(frames / vae.config.clip_length)
    if not vae.use_tiling:
        return clips
    rows = vae._split_tiles(height, vae.tile_sample_min_height, vae.tile_sample_min_overlap_height)
    cols = vae._split_tiles(width, vae.tile_sample_min_width, vae.tile_sample_min_overlap_width)
    return clips * len(rows[0]) * len(cols[0])


def condition_calls(vae, item) -> int:
    """Encoder calls of one prepared asset: an fl2va keyframe (a PIL image on the canvas) or a ref2va
    reference (its image or frames through the video encoder, its soundtrack through the audio encoder)."""
    if isinstance(item, MiniMaxH3ImageReference):
        assert isinstance(item.image, Image.Image)  # the set-up block turns every reference image into one
        return int(item.has_audio) + encoder_calls(vae, 1, item.image.height, item.image.width)
    if isinstance(item, MiniMaxH3VideoReference):
        assert isinstance(item.frames, np.ndarray)  # the set-up block's (frames, height, width, 3)
        frames, height, width = item.frames.shape[:3]
        return int(item.has_audio) + encoder_calls(vae, rules.snap_down(frames), height, width)  # what it keeps
    if isinstance(item, MiniMaxH3AudioReference):
        return int(item.has_audio)
    return encoder_calls(vae, 1, item.height, item.width)


@contextmanager
def _calls_reported(encoders: list[torch.nn.Module], total: int, progress: Progress) -> Iterator[None]:
    """Report every forward of any of `encoders` as (calls so far, total) while the blocks run."""
    done = 0

    def hook(module, args, output) -> None:
        nonlocal done
        done += 1  # one tile of one clip, or one soundtrack (its two channels are one batch)
        progress(done, total)

    handles = [encoder.register_forward_hook(hook) for encoder in encoders]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class ConditionEncoder:
    """Not re-entrant: the VAE service serialises it with decoding."""

    def __init__(self, vae, audio_vae) -> None:
        self.vae, self.audio_vae = vae, audio_vae
        self.pipes: dict[int, Any] = {}  # by common_pb2.Workflow value
        for workflow in workflows.WORKFLOWS:
            if workflow.media_fields:
                pipe = workflow.vae_encoder_block().init_pipeline()
                pipe.update_components(
                    **{
                        name: value
                        for name, value in (("vae", vae), ("audio_vae", audio_vae))
                        if name in pipe.component_names
                    }
                )
                self.pipes[workflow.value] = pipe

    def total_calls(self, media: PreparedMedia) -> int:
        return sum(condition_calls(self.vae, item) for item in media.items)

    @torch.no_grad()
    def encode(self, workflow: int, media: PreparedMedia, progress: Progress) -> Conditions:
        flow, pipe = workflows.by_value(workflow), self.pipes[workflow]
        video, audio = [], []
        with _calls_reported([self.vae.encoder, self.audio_vae.encoder], self.total_calls(media), progress):
            for item in media.items:
                visual, sound = flow.encode_condition(pipe, item)
                video += visual
                audio += sound
        tensors = {f"condition_latents.{i}": t for i, t in enumerate(video)}
        tensors.update({f"audio_condition_latents.{j}": t for j, t in enumerate(audio)})
        return Conditions(tensors, media.manifest)
