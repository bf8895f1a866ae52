"""The deployments the tests start: their files on loopback ports (`write_config`), the settings the shared stacks
use, and `Stack`, what a stack fixture hands a test."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from h3serve.cli.launcher import ServiceGroup
from h3serve.common.deploy_toml import dumps


def write_config(
    path: Path,
    model_dir: str,
    data_dir: Path,
    ports: dict[str, int],
    model: dict | None = None,
    service_keys: dict | None = None,
    dit: dict | None = None,
    **gateway,
) -> Path:
    """A deployment file: every section on loopback, extra [model] keys from `model`, `service_keys` in each
    model service section, `dit` in [dit] only, the gateway's keys from `gateway`."""
    sections: dict[str, dict] = {"model": {"dir": model_dir, **(model or {})}}
    for name in ("encoder", "dit", "vae"):
        sections[name] = {"port": ports[name], **(service_keys or {}), **((dit or {}) if name == "dit" else {})}
    sections["gateway"] = {"port": ports["gateway"], "data_dir": str(data_dir), **gateway}
    path.write_text(dumps(sections))
    return path


# Test deployments give up on a stage that stays down after a second (the shipped defaults wait minutes).
QUICK_OUTAGE = {stage: 1.0 for stage in ("encoder", "vae-encode", "dit", "vae")}

# The stack's image references are encoded at a 64 px short edge: the released 2048 px took 17 s per image on CPU.
STACK_MODEL = {"reference_image_short_edge": 64}

# The stack's admission table: one canvas no other test uses, so only the admission test meets the limit.
STACK_CAPACITY = {"t2va": {"512x512": 20000}}


# The adapter stack's LoRA files: turbo's sidecar recommends steps and shifts (what a request leaving them unset gets).
ADAPTER_SIDECAR = {"steps": 3, "flow_shift": 6.0, "audio_flow_shift": 2.5}
# Its canvas, shrunk so that keyframes and references stay small on CPU (model.rules.Geometry's fields).
ADAPTER_GEOMETRY = dict(canvas_short_edge=32, canvas_max_pixels=2048, reference_image_short_edge=64)


@dataclass
class Stack:
    config_path: Path
    group: ServiceGroup
    model_dir: Path
    ports: dict[str, int]

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    @property
    def http(self) -> str:
        """Base URL of the gateway's HTTP door (OpenAI /v1/videos, SSE, the console)."""
        return f"http://127.0.0.1:{self.ports['http']}"
