"""Keyframes and references to conditioning latents: the workflow's own VAE-encode block, asset by asset.

The block runs once per keyframe or reference, which reports progress per asset and is bit-identical
to one call over all of them: every visual condition samples its posterior under its own fresh
seed-42 generator, and soundtracks take the posterior mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from h3serve.model import workflows
from h3serve.model.workflows.base import PreparedMedia


@dataclass
class Conditions:
    tensors: dict[str, torch.Tensor]   # "condition_latents.<i>", "audio_condition_latents.<j>"
    manifest: dict                     # the DenoiseSpec fields the DiT needs with them


class ConditionEncoder:
    """Not re-entrant: the VAE service serialises it with decoding."""

    def __init__(self, vae, audio_vae) -> None:
        self.pipes = {}
        for workflow in workflows.WORKFLOWS:
            if workflow.media_fields:
                pipe = workflow.vae_encoder_block().init_pipeline()
                pipe.update_components(**{name: value for name, value in (("vae", vae), ("audio_vae", audio_vae))
                                          if name in pipe.component_names})
                self.pipes[workflow.value] = pipe

    @torch.no_grad()
    def encode(self, workflow: int, media: PreparedMedia, progress: Callable[[int, int], None]) -> Conditions:
        flow, pipe = workflows.by_value(workflow), self.pipes[workflow]
        video, audio = [], []
        for done, item in enumerate(media.items, start=1):
            visual, sound = flow.encode_condition(pipe, item)
            video += visual
            audio += sound
            progress(done, len(media.items))
        tensors = {f"condition_latents.{i}": t for i, t in enumerate(video)}
        tensors.update({f"audio_condition_latents.{j}": t for j, t in enumerate(audio)})
        return Conditions(tensors, media.manifest)
