"""Runs diffusers' MiniMax-H3 text-encoder block (Qwen3-VL) for one prompt."""

from __future__ import annotations

import threading

import torch
from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep

COMPONENTS = ["text_encoder", "tokenizer", "processor"]


class TextEncoderRunner:
    def __init__(self, components: dict) -> None:
        self.pipe = MiniMaxH3TextEncoderStep().init_pipeline()
        self.pipe.update_components(**{name: components[name] for name in COMPONENTS})
        self.runs = 0
        self._lock = threading.Lock()  # one forward at a time: the pipeline object is not re-entrant

    @torch.no_grad()
    def encode(self, prompt: str) -> dict[str, torch.Tensor]:
        with self._lock:
            self.runs += 1
            out = self.pipe(prompt=prompt, output=["prompt_embeds", "text_token_tags"])
        return {"prompt_embeds": out["prompt_embeds"], "text_token_tags": out["text_token_tags"]}
