"""Runs one t2va denoise request on the transformer: the DiT service's model runner."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from services.dit.loop import StepObserver, t2va_core_blocks

COMPONENTS = ["transformer", "scheduler", "audio_scheduler"]


@dataclass(frozen=True)
class DenoiseJob:
    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    seed: int


class DenoiseRunner:
    """Holds the pipeline; not re-entrant (the schedulers keep per-request state)."""

    def __init__(self, components: dict) -> None:
        self.pipe = t2va_core_blocks().init_pipeline()
        self.pipe.update_components(**{name: components[name] for name in COMPONENTS})
        self.device = components["transformer"].device

    @torch.no_grad()
    def run(self, job: DenoiseJob, prompt_embeds: torch.Tensor, text_token_tags: torch.Tensor,
            observer: StepObserver) -> dict[str, torch.Tensor]:
        # Noise is drawn on the CPU from the request's generator, as the reference pipeline does,
        # so a seed means the same video on every device. The packed layout is built on the CPU
        # too, from CPU row tags (as the text-encoder block returns them).
        out = self.pipe(
            prompt_embeds=prompt_embeds.to(self.device), text_token_tags=text_token_tags.cpu(),
            height=job.height, width=job.width, num_frames=job.num_frames,
            num_inference_steps=job.num_inference_steps, generator=torch.Generator().manual_seed(job.seed),
            step_observer=observer, output=["latents", "audio_latents"],
        )
        return {name: out[name].to("cpu", torch.float32) for name in ("latents", "audio_latents")}


class StepClock:
    """Turns (step, total) callbacks into per-step wall times."""

    def __init__(self) -> None:
        self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds
