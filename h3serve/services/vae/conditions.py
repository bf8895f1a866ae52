"""Keyframes and references to conditioning latents: diffusers' fl2va / ref2va VAE-encode blocks.

The blocks run once per keyframe or reference, which reports progress per asset and is bit-identical
to one call over all of them: every visual condition samples its posterior under its own fresh
seed-42 generator, and soundtracks take the posterior mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from diffusers.modular_pipelines.minimax_h3.encoders import (
    MiniMaxH3KeyframeVaeEncoderStep,
    MiniMaxH3Ref2VAReferenceEncoderStep,
)

from h3serve.v1 import common_pb2, media_pb2
from h3serve.runtime.media import PreparedMedia

KINDS = {"image": media_pb2.ASSET_KIND_IMAGE, "video": media_pb2.ASSET_KIND_VIDEO, "audio": media_pb2.ASSET_KIND_AUDIO}


@dataclass
class Conditions:
    tensors: dict[str, torch.Tensor]              # "condition_latents.<i>", "audio_condition_latents.<j>"
    keyframe_anchors: tuple[str, ...]
    references: list[media_pb2.ReferenceEntry]


class ConditionEncoder:
    """Not re-entrant: the VAE service serialises it with decoding."""

    def __init__(self, vae, audio_vae) -> None:
        self.keyframes = MiniMaxH3KeyframeVaeEncoderStep().init_pipeline()
        self.keyframes.update_components(vae=vae)
        self.references = MiniMaxH3Ref2VAReferenceEncoderStep().init_pipeline()
        self.references.update_components(vae=vae, audio_vae=audio_vae)

    @torch.no_grad()
    def encode(self, media: PreparedMedia, progress: Callable[[int, int], None]) -> Conditions:
        video, audio = [], []
        items = media.items()
        for done, item in enumerate(items, start=1):
            if media.workflow == common_pb2.WORKFLOW_FL2VA:
                video += self.keyframes(keyframes=[item], output="condition_latents")
            else:
                out = self.references(normalized_references=[item],
                                      output=["condition_latents", "audio_condition_latents"])
                video += out["condition_latents"]
                audio += out["audio_condition_latents"]
            progress(done, len(items))
        tensors = {f"condition_latents.{i}": t for i, t in enumerate(video)}
        tensors.update({f"audio_condition_latents.{j}": t for j, t in enumerate(audio)})
        references = [media_pb2.ReferenceEntry(kind=KINDS[r.kind], has_audio=r.has_audio)
                      for r in media.normalized_references]
        return Conditions(tensors, media.keyframe_anchors, references)
