"""`h3serve reference`: diffusers' own in-process MiniMaxH3Blocks on the same model, seed and media.

Writes the same `.npz` layout as the VAE service's raw output, so the two can be compared
byte for byte. Keyframes and references are decoded from their files as the stages decode them.
LoRA adapters are loaded as a diffusers user loads them (`load_lora_weights`, `set_adapters`), from the
deployment file's `[dit] adapters`, and the request options are resolved as the gateway resolves them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from h3serve.common.config import SERVICES, AdapterSource, DeployConfig
from h3serve.model import adapters, workflows
from h3serve.model.adapters import AdapterCatalog, AdapterFacts
from h3serve.model.rules import Geometry
from h3serve.runtime import checkpoints
from h3serve.runtime.media import decode_reference
from h3serve.runtime.models import ModelSource
from h3serve.v1 import common_pb2, media_pb2

T2VA_COMPONENTS = [
    "text_encoder",
    "tokenizer",
    "processor",
    "transformer",
    "scheduler",
    "audio_scheduler",
    "vae",
    "audio_vae",
]
ROWS = ("num_condition_video_rows", "num_condition_audio_rows")  # packed rows of keyframes / references
KINDS = {"image": media_pb2.ASSET_KIND_IMAGE, "video": media_pb2.ASSET_KIND_VIDEO, "audio": media_pb2.ASSET_KIND_AUDIO}


@dataclass(frozen=True)
class ReferenceRequest:
    prompt: str
    height: int | None
    width: int | None
    num_frames: int
    params: common_pb2.GenerationParams  # resolved (`resolved_params`): steps, seed, adapters and shifts set
    first_frame: str | None = None  # fl2va keyframe files
    last_frame: str | None = None
    references: tuple[tuple[str, str], ...] = ()  # ref2va: ("image" | "video" | "audio", path), request order

    def media_inputs(self) -> dict:
        """The keyframe / reference inputs of MiniMaxH3Blocks, decoded from the files (per GenerateRequest field)."""
        files = {
            "first_frame": [("image", self.first_frame)] if self.first_frame else [],
            "last_frame": [("image", self.last_frame)] if self.last_frame else [],
            "references": list(self.references),
        }
        decoded = {
            field: [decode_reference(KINDS[kind], path) for kind, path in items]
            for field, items in files.items()
            if items
        }
        return workflows.of_fields(decoded).pipeline_inputs(decoded)


def resolved_params(
    sources: dict[str, AdapterSource], params: common_pb2.GenerationParams, default_steps: int
) -> common_pb2.GenerationParams:
    """`params` resolved as the gateway resolves them (h3serve/model/adapters.py), the deployment file's adapters
    and their sidecars standing in for the DiT's Info; ValueError names an adapter the file does not hold."""
    unknown = [a.name for a in params.adapters if a.name not in sources]
    if unknown:
        raise ValueError(
            f"adapter {unknown[0]!r} is not in the deployment's [dit] adapters ({', '.join(sorted(sources)) or 'none'})"
        )
    catalog = AdapterCatalog(
        {
            name: AdapterFacts(name, (), recommended=adapters.read_sidecar(source.path))
            for name, source in sources.items()
        }
    )
    resolved = common_pb2.GenerationParams()
    resolved.CopyFrom(params)
    adapters.resolve(resolved, catalog, default_steps)
    return resolved


def base_params(steps: int, seed: int, **given) -> common_pb2.GenerationParams:
    """Resolved params for the base model (no adapter sidecars): `steps`, `seed` and the `given` options, the
    released model's shifts for the rest."""
    return resolved_params({}, common_pb2.GenerationParams(num_inference_steps=steps, seed=seed, **given), steps)


def service_threads(config: DeployConfig) -> tuple[int, str]:
    """The torch threads the reference runs with, and a note when the services disagree.

    The thread count decides how CPU kernels split their reductions, so matching bytes need the services' own
    `threads` (0: torch's default). One process runs every stage here; when they differ, the DiT's wins.
    """
    threads = {name: config.service(name).threads for name in SERVICES}
    if len(set(threads.values())) == 1:
        return threads["dit"], ""
    chosen = threads["dit"]
    listed = ", ".join(f"{name} {count or 'default'}" for name, count in threads.items())
    others = ", ".join(name for name, count in threads.items() if count != chosen)
    return chosen, (
        f"the services' threads differ ({listed}): using the DiT's ({chosen or 'default'}); "
        f"the {others} stage may differ from the served bytes in the last bits"
    )


def reference_pipeline(
    source: ModelSource,
    with_references: bool = False,
    device: str = "cpu",
    dtype: str = "float32",
    geometry: Geometry = Geometry(),
):
    """diffusers' MiniMaxH3Blocks on `source`'s components (`transformer_ref` too for ref2va), reusable."""
    from diffusers.modular_pipelines import MiniMaxH3Blocks

    names = [*T2VA_COMPONENTS, "transformer_ref"] if with_references else T2VA_COMPONENTS
    if source.transformer_file:  # [dit] transformer_file: refused as the DiT refuses it, before anything loads
        assert source.model_dir is not None  # the config refuses a transformer_file without a model dir
        checkpoints.check(source.transformer_file, source.model_dir)
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(**source.load(names, device, dtype), **geometry.pipeline_configs())
    return pipe


def load_adapters(pipe, sources: dict[str, AdapterSource]) -> None:
    """diffusers' own loader, as a user of the pipeline calls it: each adapter under its name, routed by diffusers."""
    for name, source in sources.items():
        pipe.load_lora_weights(source.path, adapter_name=name, load_into_transformer_ref=source.transformer_ref)


def run_pipeline(pipe, request: ReferenceRequest) -> dict[str, np.ndarray]:
    """One request through a `reference_pipeline`: the decoded frames, waveform, sample rate, and the rows diffusers
    packed: condition rows (video, audio), text rows (the text encoder's output) and the whole sequence. The
    request's adapters must be loaded (`load_adapters`)."""
    params = request.params
    if params.adapters:
        pipe.set_adapters([a.name for a in params.adapters], [a.weight for a in params.adapters])
    pipe.scheduler.set_shift(params.flow_shift)
    pipe.audio_scheduler.set_shift(params.audio_flow_shift)
    out = pipe(
        prompt=request.prompt,
        height=request.height,
        width=request.width,
        num_frames=request.num_frames,
        num_inference_steps=params.num_inference_steps,
        generator=torch.Generator().manual_seed(params.seed),
        output_type="np",
        output=["videos", "audio", "sampling_rate", *ROWS, "text_token_tags", "token_tags"],
        **request.media_inputs(),
    )
    return {
        "frames": out["videos"][0],
        "audio": out["audio"][0].cpu().numpy(),
        "sample_rate": np.asarray(out["sampling_rate"]),
        "condition_rows": np.asarray([int(out[name] or 0) for name in ROWS]),
        "text_rows": np.asarray(len(out["text_token_tags"])),
        "packed_rows": np.asarray(len(out["token_tags"])),
    }


def run_reference(
    source: ModelSource,
    request: ReferenceRequest,
    device: str = "cpu",
    dtype: str = "float32",
    geometry: Geometry = Geometry(),
    adapter_sources: dict[str, AdapterSource] | None = None,
) -> dict[str, np.ndarray]:
    """One request on a fresh pipeline; `adapter_sources` (the [dit] adapters) holds the adapters it names."""
    pipe = reference_pipeline(source, bool(request.references), device, dtype, geometry)
    load_adapters(pipe, {a.name: (adapter_sources or {})[a.name] for a in request.params.adapters})
    return run_pipeline(pipe, request)
