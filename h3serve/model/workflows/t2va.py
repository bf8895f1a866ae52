"""t2va: text to video + audio. No media: the prompt alone conditions the generation."""

from __future__ import annotations

from h3serve.model.workflows.base import Workflow
from h3serve.v1 import common_pb2


class T2VA(Workflow):
    name = "t2va"
    value = common_pb2.WORKFLOW_T2VA

    def text_encoder_block(self):
        from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep

        return MiniMaxH3TextEncoderStep()

    def core_denoise_step(self):
        from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3CoreDenoiseStep

        return MiniMaxH3CoreDenoiseStep()
