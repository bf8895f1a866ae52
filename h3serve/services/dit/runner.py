"""Runs one denoise request (t2va, fl2va or ref2va) on the transformer: the DiT service's model runner."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from h3serve.v1 import common_pb2
from h3serve.services.dit import workflows as wf
from h3serve.services.dit.loop import StepObserver

CONDITION_ROWS = ("num_condition_video_rows", "num_condition_audio_rows")


@dataclass(frozen=True)
class DenoiseJob:
    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    seed: int
    workflow: int = common_pb2.WORKFLOW_T2VA


class DenoiseRunner:
    """Holds the pipeline; not re-entrant (the schedulers keep per-request state)."""

    def __init__(self, components: dict, workflows: tuple[int, ...] = (common_pb2.WORKFLOW_T2VA,)) -> None:
        self.pipes = {}
        for workflow in workflows:
            pipe = wf.core_blocks(workflow).init_pipeline()
            pipe.set_progress_bar_config(disable=True)  # progress leaves as events, not as a bar on stderr
            pipe.update_components(**{name: components[name] for name in [wf.PARTITIONS[workflow], *wf.SCHEDULERS]})
            self.pipes[workflow] = pipe
        self.device = components[wf.partitions(list(workflows))[0]].device
        self.condition_rows = (0, 0)  # of the last run: (video, audio) rows taken by keyframes / references

    @torch.no_grad()
    def run(self, job: DenoiseJob, prompt_embeds: torch.Tensor, text_token_tags: torch.Tensor,
            observer: StepObserver, conditioning: wf.Conditioning | None = None) -> dict[str, torch.Tensor]:
        # Noise is drawn on the CPU from the request's generator, as the reference pipeline does,
        # so a seed means the same video on every device. The packed layout is built on the CPU
        # too, from CPU row tags (as the text-encoder block returns them).
        # Conditioning latents stay on the CPU, as diffusers' VAE-encode blocks return them.
        out = self.pipes[job.workflow](
            prompt_embeds=prompt_embeds.to(self.device), text_token_tags=text_token_tags.cpu(),
            height=job.height, width=job.width, num_frames=job.num_frames,
            num_inference_steps=job.num_inference_steps, generator=torch.Generator().manual_seed(job.seed),
            step_observer=observer, output=["latents", "audio_latents", *CONDITION_ROWS],
            **(conditioning or wf.Conditioning()).inputs,
        )
        self.condition_rows = tuple(int(out[name] or 0) for name in CONDITION_ROWS)
        return {name: out[name].to("cpu", torch.float32) for name in ("latents", "audio_latents")}


class StepClock:
    """Turns (step, total) callbacks into per-step wall times."""

    def __init__(self) -> None:
        self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds
