"""What the VAE checks of a request before it decodes or encodes anything.

Decode takes the DiT's latents: their bytes are bounded by the deployment's geometry before a buffer is
allocated (the largest canvas, the longest video), and once they arrived they must decode into a video the
model makes (17n+5 frames in range, a canvas within the geometry) with the soundtrack of its length.
"""

from __future__ import annotations

from h3serve.common.bounds import check_id
from h3serve.common.config import ModelServiceConfig
from h3serve.model import rules
from h3serve.model.rules import InvalidRequest
from h3serve.runtime import wire
from h3serve.services.vae.decode import DecodePlan, VaeDecoder
from h3serve.v1 import vae_pb2

TENSORS = ("latents", "audio_latents")
FLOAT32_BYTES = 4


def largest_latents_bytes(decoder: VaeDecoder, config: ModelServiceConfig) -> int:
    """float32 bytes of the latents of the longest video on the largest canvas the geometry resolves."""
    frames = rules.VALID_NUM_FRAMES[-1]
    video = (
        decoder.vae.config.latent_channels
        * rules.latent_frames(frames)
        * rules.largest_resolved_canvas_pixels(config.geometry)
        // rules.VAE_SPATIAL_RATIO**2
    )
    audio = rules.AUDIO_CHANNELS * decoder.audio_vae.config.latent_channels * rules.audio_latents(frames)
    return FLOAT32_BYTES * (video + audio)


def decode_expected(spec: vae_pb2.DecodeSpec, decoder: VaeDecoder, config: ModelServiceConfig) -> wire.Expected:
    check_id("job_id", spec.job_id)
    return wire.Expected(TENSORS, min(config.max_input_bytes, largest_latents_bytes(decoder, config)))


def check_plan(plan: DecodePlan, audio_latents: int, config: ModelServiceConfig) -> None:
    """What the latents decode into (the plan, whose shapes the decoder checked) is a video the model makes."""
    try:
        rules.check_num_frames(plan.frames)
        rules.check_resolved_canvas(plan.height, plan.width, config.geometry)
    except InvalidRequest as exc:
        raise InvalidRequest(
            "latents", f"they decode to {plan.frames} frames of {plan.height}x{plan.width}: {exc}"
        ) from exc
    if audio_latents != rules.audio_latents(plan.frames):
        raise InvalidRequest(
            "audio_latents",
            f"{audio_latents} latents per channel; {plan.frames} frames have {rules.audio_latents(plan.frames)}",
        )
