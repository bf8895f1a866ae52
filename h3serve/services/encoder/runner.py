"""Runs diffusers' MiniMax-H3 text-encoder blocks (Qwen3-VL) for one prompt, with or without media."""

from __future__ import annotations

import threading

import torch
from diffusers.modular_pipelines.minimax_h3.encoders import (
    MiniMaxH3FL2VATextEncoderStep,
    MiniMaxH3Ref2VATextEncoderStep,
    MiniMaxH3TextEncoderStep,
)

from h3serve.v1 import common_pb2
from h3serve.runtime.media import PreparedMedia

COMPONENTS = ["text_encoder", "tokenizer", "processor"]
OUTPUTS = ["prompt_embeds", "text_token_tags"]
MEDIA_BLOCKS = {common_pb2.WORKFLOW_FL2VA: MiniMaxH3FL2VATextEncoderStep,
                common_pb2.WORKFLOW_REF2VA: MiniMaxH3Ref2VATextEncoderStep}


def _pipeline(block, components: dict):
    pipe = block.init_pipeline()
    pipe.update_components(**{name: components[name] for name in COMPONENTS})
    return pipe


class TextEncoderRunner:
    def __init__(self, components: dict) -> None:
        self.pipe = _pipeline(MiniMaxH3TextEncoderStep(), components)
        self.media_pipes = {workflow: _pipeline(block(), components) for workflow, block in MEDIA_BLOCKS.items()}
        self.runs = 0
        self._lock = threading.Lock()  # one forward at a time: the pipeline object is not re-entrant

    @torch.no_grad()
    def encode(self, prompt: str) -> dict[str, torch.Tensor]:
        return self._run(self.pipe, prompt=prompt)

    @torch.no_grad()
    def encode_media(self, prompt: str, media: PreparedMedia) -> dict[str, torch.Tensor]:
        """The fl2va / ref2va presentation: a label and a vision block per keyframe or reference, then the prompt."""
        return self._run(self.media_pipes[media.workflow], prompt=prompt, **media.block_inputs())

    def _run(self, pipe, **inputs) -> dict[str, torch.Tensor]:
        with self._lock:
            self.runs += 1
            out = pipe(**inputs, output=OUTPUTS)
        return {name: out[name] for name in OUTPUTS}
