"""Runs one denoise request (any workflow) on the transformer: the DiT service's model runner."""

from __future__ import annotations

import time

import torch

from h3serve.model import workflows
from h3serve.model.adapters import DEFAULT_SHIFTS
from h3serve.model.workflows.base import Workflow
from h3serve.runtime import memory
from h3serve.services.dit.adapters import Adapters
from h3serve.services.dit.loop import StepObserver, observed
from h3serve.v1 import dit_pb2

SCHEDULERS = ["scheduler", "audio_scheduler"]
CONDITION_ROWS = ("num_condition_video_rows", "num_condition_audio_rows")


def served(names: tuple[str, ...] | list[str]) -> list[Workflow]:
    """The workflows of the config's names; ValueError names the unknown ones."""
    if not names:
        raise ValueError(f"workflows: none given; choose from {', '.join(workflows.names())}")
    return [workflows.by_name(name) for name in names]


def partitions(flows: list[Workflow]) -> list[str]:
    """The transformer partitions `flows` run on, in a fixed order."""
    needed = {flow.partition for flow in flows}
    return [name for name in ("transformer", "transformer_ref") if name in needed]


def computing_on(pipe, device: torch.device) -> None:
    """Fix diffusers' execution device of `pipe` (where its blocks put the latents) to `device`. diffusers infers it
    from group offload's hooks, else from the first model's weights: FSDP2 shards kept in host memory
    (`fsdp_offload`) say the CPU, while the blocks run on the GPU."""
    kind = type(pipe)
    pipe.__class__ = type(kind.__name__, (kind,), {"_execution_device": property(lambda _pipe: device)})


class DenoiseRunner:
    """Holds one pipeline per served workflow; not re-entrant (the schedulers keep per-request state)."""

    def __init__(
        self,
        components: dict,
        flows: list[Workflow],
        adapters: Adapters | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.adapters = adapters or Adapters()
        self.schedulers = [components[name] for name in SCHEDULERS]  # shared by the pipes, in DEFAULT_SHIFTS' order
        self.pipes = {}
        for flow in flows:
            pipe = observed(flow.core_denoise_step()).init_pipeline()
            pipe.set_progress_bar_config(disable=True)  # progress leaves as events, not as a bar on stderr
            pipe.update_components(**{name: components[name] for name in [flow.partition, *SCHEDULERS]})
            self.pipes[flow.value] = pipe
        # where it computes: the transformer's weights may be elsewhere (host memory, with offload)
        self.device = device or components[partitions(flows)[0]].device
        for pipe in self.pipes.values():
            computing_on(pipe, self.device)
        self.condition_rows = (0, 0)  # of the last run: (video, audio) rows taken by keyframes / references

    @torch.no_grad()
    def run(
        self,
        spec: dit_pb2.DenoiseSpec,
        prompt_embeds: torch.Tensor,
        text_token_tags: torch.Tensor,
        observer: StepObserver,
        conditioning: dict | None = None,
    ) -> dict[str, torch.Tensor]:
        # Noise is drawn on the CPU from the request's generator, as the reference pipeline does,
        # so a seed means the same video on every device. The packed layout is built on the CPU
        # too, from CPU row tags (as the text-encoder block returns them).
        # Conditioning latents stay on the CPU, as diffusers' VAE-encode blocks return them.
        flow = workflows.by_value(spec.workflow)
        self.adapters.apply(flow.partition, spec.params.adapters)
        self._set_shifts(spec.params)
        try:
            out = self.pipes[flow.value](
                prompt_embeds=prompt_embeds.to(self.device),
                text_token_tags=text_token_tags.cpu(),
                height=spec.height,
                width=spec.width,
                num_frames=spec.num_frames,
                num_inference_steps=spec.params.num_inference_steps,
                generator=torch.Generator().manual_seed(spec.params.seed),
                step_observer=observer,
                output=["latents", "audio_latents", *CONDITION_ROWS],
                **(conditioning or {}),
            )
            video_rows, audio_rows = (int(out[name] or 0) for name in CONDITION_ROWS)
            self.condition_rows = (video_rows, audio_rows)
            latents = {name: out[name].to("cpu", torch.float32) for name in ("latents", "audio_latents")}
            del out
            return latents
        finally:
            # Every rank, after every request (cancelled and failed ones too): the allocator's cache goes back to
            # the driver, so a stage sharing this GPU can use it. Cheap (milliseconds against seconds per step);
            # the peak the group reports (max_memory_allocated) is not changed by it.
            memory.release(self.device)

    def _set_shifts(self, params) -> None:
        """Each schedule's shift for this request (unset: the scheduler's configured one), before the pipeline sets
        its timesteps: the schedulers are shared, so every request sets both."""
        for scheduler, key in zip(self.schedulers, DEFAULT_SHIFTS, strict=True):
            scheduler.set_shift(getattr(params, key) if params.HasField(key) else scheduler.config.shift)


class StepClock:
    """Turns (step, total) callbacks into per-step wall times."""

    def __init__(self) -> None:
        self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds
