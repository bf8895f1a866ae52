"""The jobs an experiment submits: the load file's mix, its media uploaded, drawn by weight into requests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from h3serve.experiment.loadspec import LoadSpec, MixEntry, weights
from h3serve.experiment.media import Uploads, made_media
from h3serve.model import adapters
from h3serve.v1 import common_pb2, gateway_pb2


@dataclass(frozen=True)
class JobKind:
    """One mix entry with its keyframes / references as asset ids."""

    entry: MixEntry
    first_frame: str = ""
    last_frame: str = ""
    references: tuple[str, ...] = ()

    def request(self, index: int, request_id: str) -> gateway_pb2.GenerateRequest:
        """Job `index`'s request; its seed is the index, so a configuration's jobs match another's one for one."""
        e = self.entry
        params = common_pb2.GenerationParams(
            num_inference_steps=e.steps, seed=index, adapters=[adapters.parse(text) for text in e.adapters]
        )
        return gateway_pb2.GenerateRequest(
            prompt=e.prompt.replace("{index}", str(index)),
            height=e.height,
            width=e.width,
            num_frames=e.num_frames,
            params=params,
            workflow=common_pb2.Workflow.Value(f"WORKFLOW_{e.workflow.upper()}"),
            first_frame=self.first_frame,
            last_frame=self.last_frame,
            request_id=request_id,
            references=[gateway_pb2.ReferenceInput(asset_id=asset) for asset in self.references],
        )


def prepare(spec: LoadSpec, upload: Uploads, media_dir: Path) -> list[JobKind]:
    """Upload each entry's media (the files it names, or small ones made for it)."""
    kinds = []
    for number, entry in enumerate(spec.mix):
        files: dict[str, list[str] | list[Path]] = {
            "first_frame": [entry.first_frame] if entry.first_frame else [],
            "last_frame": [entry.last_frame] if entry.last_frame else [],
            "references": list(entry.references),
        }
        if not any(files.values()):
            files.update(made_media(entry.workflow, entry.width, entry.height, media_dir, spec.seed + number))
        ids = {field: [upload(path) for path in paths] for field, paths in files.items()}
        first_frame, last_frame = (ids[f][0] if ids[f] else "" for f in ("first_frame", "last_frame"))
        kinds.append(JobKind(entry, first_frame, last_frame, tuple(ids["references"])))
    return kinds


class Mix:
    """The kind of job `index`, drawn by the mix's weights from a generator of its own per job: the same job number
    gets the same kind in every run with the same seed, in whatever order a closed loop's clients reach it, and
    the arrival times (arrivals.poisson) do not depend on the mix."""

    def __init__(self, spec: LoadSpec) -> None:
        self.seed, self.weights = spec.seed, weights(spec)

    def kind(self, index: int) -> int:
        return int(np.random.default_rng([self.seed, 1, index]).choice(len(self.weights), p=self.weights))
