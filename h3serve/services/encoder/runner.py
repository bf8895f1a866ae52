"""Runs diffusers' MiniMax-H3 text-encoder block (Qwen3-VL) of a workflow for one prompt, with its media if any."""

from __future__ import annotations

import threading

import torch

from h3serve.model import workflows
from h3serve.model.workflows.base import PreparedMedia
from h3serve.v1 import common_pb2

COMPONENTS = ["text_encoder", "tokenizer", "processor"]
OUTPUTS = ["prompt_embeds", "text_token_tags"]
WARMUP_PROMPT = "a warm-up prompt, encoded once at start"


class TextEncoderRunner:
    def __init__(self, components: dict) -> None:
        self.tokenizer = components["tokenizer"]  # the service counts a prompt's tokens before it runs
        self.pipes = {}
        for workflow in workflows.WORKFLOWS:
            pipe = workflow.text_encoder_block().init_pipeline()
            pipe.update_components(**{name: components[name] for name in COMPONENTS})
            self.pipes[workflow.value] = pipe
        self.runs = 0
        self._lock = threading.Lock()  # one forward at a time: the pipeline object is not re-entrant

    @torch.no_grad()
    def encode(self, prompt: str, workflow: int, media: PreparedMedia | None = None) -> dict[str, torch.Tensor]:
        """The workflow's presentation: a label and a vision block per keyframe or reference, then the prompt."""
        with self._lock:
            self.runs += 1
            return self._run(prompt, workflow, media)

    @torch.no_grad()
    def warm_up(self) -> None:
        """One t2va prompt before the service serves, not counted in `runs`: a process's first encode pays the device's
        one-time set-up (on one H200 the first request's encode took 0.62-0.66 s, later ones 0.07-0.12 s)."""
        with self._lock:
            self._run(WARMUP_PROMPT, common_pb2.WORKFLOW_T2VA)

    def _run(self, prompt: str, workflow: int, media: PreparedMedia | None = None) -> dict[str, torch.Tensor]:
        out = self.pipes[workflows.by_value(workflow).value](
            prompt=prompt, **(media.inputs if media else {}), output=OUTPUTS
        )
        return {name: out[name] for name in OUTPUTS}
