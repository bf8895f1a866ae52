"""`h3serve reference`: diffusers' own in-process MiniMaxH3Blocks on the same model and seed.

Writes the same `.npz` layout as the VAE service's raw output, so the two can be compared
byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.common.models import ModelSource

T2VA_COMPONENTS = ["text_encoder", "tokenizer", "processor", "transformer", "scheduler", "audio_scheduler",
                   "vae", "audio_vae"]


@dataclass(frozen=True)
class ReferenceRequest:
    prompt: str
    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    seed: int


def run_reference(source: ModelSource, request: ReferenceRequest, device: str = "cpu",
                  dtype: str = "float32") -> dict[str, np.ndarray]:
    from diffusers.modular_pipelines import MiniMaxH3Blocks

    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(**source.load(T2VA_COMPONENTS, device, dtype))
    out = pipe(prompt=request.prompt, height=request.height, width=request.width, num_frames=request.num_frames,
               num_inference_steps=request.num_inference_steps,
               generator=torch.Generator().manual_seed(request.seed), output_type="np",
               output=["videos", "audio", "sampling_rate"])
    return {"frames": out["videos"][0], "audio": out["audio"][0].cpu().numpy(),
            "sample_rate": np.asarray(out["sampling_rate"])}
