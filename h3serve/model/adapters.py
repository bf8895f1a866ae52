"""LoRA adapters and schedule shifts of one request: the rules the gateway and the DiT both apply, torch-free.

A DiT loads its adapters at start (`[dit] adapters`) and reports them in its Info (`DiTInfo.adapters`); an
`AdapterCatalog` is that report. `check` refuses what a request may not ask of it (an unknown name, a weight or shift
out of bounds, an adapter that does not target the workflow's partition), at the gateway and again at the DiT's
boundary. `resolve` fills what a request leaves unset, so the resolved request says exactly what runs: each weight
(0 means 1.0), the steps and shifts the first recommending adapter's sidecar gives, else the released model's shifts.
An adapter's sidecar (`turbo4.json` next to `turbo4.safetensors`) is read here, so the deployment file's check and
the DiT's Info read it alike.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from h3serve.model.rules import MIN_STEPS, InvalidRequest
from h3serve.model.workflows.base import Workflow
from h3serve.v1 import common_pb2, dit_pb2

# The released schedulers' shifts (diffusers' MiniMaxH3Scheduler: 12 for the video rows, 3 for the audio rows).
DEFAULT_SHIFTS = {"flow_shift": 12.0, "audio_flow_shift": 3.0}
MAX_SHIFT = 100.0
MAX_WEIGHT = 10.0
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
NAME_RULE = "1-64 characters of A-Z a-z 0-9 _ . -, starting with a letter or digit"
UNFUSED, FUSED = "unfused", "fused"
SIDECAR_KEYS = ("steps", *DEFAULT_SHIFTS)


def parse(text: str) -> common_pb2.Adapter:
    """An adapter as people write it, "name[:weight]" (no weight: 0, which means 1.0); ValueError says why not."""
    name, _, weight = text.partition(":")
    try:
        return common_pb2.Adapter(name=name, weight=float(weight or 0.0))
    except ValueError:
        raise ValueError(f"NAME[:WEIGHT] with a number as the weight, got {text!r}") from None


def shift_problem(value: float) -> str:
    """Why `value` is not a usable shift ("" when it is)."""
    if not (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= MAX_SHIFT
    ):
        return f"must be a number with 0 < shift <= {MAX_SHIFT:g}, got {value!r}"
    return ""


@dataclass(frozen=True)
class Recommendation:
    """What an adapter's sidecar recommends for the request options a request leaves unset."""

    steps: int = 0  # num_inference_steps; 0: none
    flow_shift: float | None = None
    audio_flow_shift: float | None = None


def sidecar_path(adapter_path: str | Path) -> Path:
    return Path(adapter_path).with_suffix(".json")


def read_sidecar(adapter_path: str | Path) -> Recommendation:
    """The recommendation in the JSON next to an adapter file, e.g. {"steps": 5, "flow_shift": 6.0,
    "audio_flow_shift": 3.0}, each key optional; no such file: none. ValueError says what is wrong."""
    path = sidecar_path(adapter_path)
    if not path.is_file():
        return Recommendation()
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"sidecar {path}: not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"sidecar {path}: must be a JSON object with {', '.join(SIDECAR_KEYS)}")
    unknown = sorted(set(data) - set(SIDECAR_KEYS))
    if unknown:
        raise ValueError(f"sidecar {path}: unknown key {unknown[0]!r}; known: {', '.join(SIDECAR_KEYS)}")
    steps = data.get("steps", 0)
    if "steps" in data and not (type(steps) is int and steps >= MIN_STEPS):
        raise ValueError(
            f"sidecar {path}: steps must be an integer >= {MIN_STEPS} (num_inference_steps: N gives "
            f"N-1 forwards), got {steps!r}"
        )
    for key in DEFAULT_SHIFTS:
        if key in data and shift_problem(data[key]):
            raise ValueError(f"sidecar {path}: {key} {shift_problem(data[key])}")
    return Recommendation(steps, *(None if data.get(key) is None else float(data[key]) for key in DEFAULT_SHIFTS))


@dataclass(frozen=True)
class AdapterFacts:
    """One adapter a DiT holds, as its Info reports it (dit.proto AdapterInfo)."""

    name: str
    partitions: tuple[str, ...]
    rank: int = 0
    alpha: float = 0.0  # the training alpha the file records; 0: none (scale 1.0)
    recommended: Recommendation = Recommendation()
    fused: bool = False

    @classmethod
    def from_info(cls, info: dit_pb2.AdapterInfo) -> AdapterFacts:
        shifts = [
            getattr(info, f"recommended_{key}") if info.HasField(f"recommended_{key}") else None
            for key in DEFAULT_SHIFTS
        ]
        return cls(
            info.name,
            tuple(info.partitions),
            info.rank,
            info.alpha,
            Recommendation(info.recommended_steps, *shifts),
            info.fused,
        )

    def to_info(self) -> dit_pb2.AdapterInfo:
        info = dit_pb2.AdapterInfo(
            name=self.name,
            partitions=self.partitions,
            rank=self.rank,
            alpha=self.alpha,
            recommended_steps=self.recommended.steps,
            fused=self.fused,
        )
        for key in DEFAULT_SHIFTS:
            if getattr(self.recommended, key) is not None:
                setattr(info, f"recommended_{key}", getattr(self.recommended, key))
        return info


@dataclass(frozen=True)
class AdapterCatalog:
    """The adapters a deployment's DiT holds: by name, and how many one request may name (0: any)."""

    adapters: dict[str, AdapterFacts] = field(default_factory=dict)
    max_per_request: int = 0

    @classmethod
    def from_info(cls, info: dit_pb2.DiTInfo) -> AdapterCatalog:
        return cls({a.name: AdapterFacts.from_info(a) for a in info.adapters}, info.max_request_adapters)

    def merged(self, other: AdapterCatalog) -> AdapterCatalog:
        """Several DiT replicas (which should load the same adapters): every name, the tightest count."""
        counts = [n for n in (self.max_per_request, other.max_per_request) if n]
        return AdapterCatalog({**other.adapters, **self.adapters}, min(counts, default=0))

    @property
    def fused(self) -> AdapterFacts | None:
        """The adapter merged into the weights (adapter_mode "fused"): every request runs it."""
        return next((facts for facts in self.adapters.values() if facts.fused), None)

    def loaded(self) -> str:
        return ", ".join(sorted(self.adapters)) or "none ([dit] adapters is empty)"


def check(params: common_pb2.GenerationParams, workflow: Workflow, catalog: AdapterCatalog) -> None:
    """InvalidRequest naming the field, for adapters or shifts `catalog`'s DiT cannot run for `workflow`."""
    for key in DEFAULT_SHIFTS:
        if params.HasField(key) and shift_problem(getattr(params, key)):
            raise InvalidRequest(key, shift_problem(getattr(params, key)))
    names = [adapter.name for adapter in params.adapters]
    if catalog.max_per_request and len(names) > catalog.max_per_request:
        raise InvalidRequest(
            "adapters",
            f"at most {catalog.max_per_request} per request on this DiT (its adapter "
            f"slots: a compiled transformer switches adapters in place), got {len(names)}",
        )
    for adapter in params.adapters:
        _check_one(adapter, workflow, catalog)
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise InvalidRequest("adapters", f"{repeated[0]} is named twice; name each adapter once")


def _check_one(adapter: common_pb2.Adapter, workflow: Workflow, catalog: AdapterCatalog) -> None:
    if not NAME.fullmatch(adapter.name):
        raise InvalidRequest(
            "adapters",
            f"a name is {NAME_RULE}; got {len(adapter.name)} characters that are not one (loaded: {catalog.loaded()})",
        )
    facts = catalog.adapters.get(adapter.name)
    if facts is None:
        raise InvalidRequest("adapters", f"unknown adapter {adapter.name!r}; this DiT loads {catalog.loaded()}")
    if not (math.isfinite(adapter.weight) and abs(adapter.weight) <= MAX_WEIGHT):
        raise InvalidRequest(
            "adapters",
            f"{adapter.name}: weight must be within -{MAX_WEIGHT:g}..{MAX_WEIGHT:g} "
            f"(0 means 1.0), got {adapter.weight!r}",
        )
    fused = catalog.fused
    if fused is not None and (adapter.name != fused.name or adapter.weight not in (0.0, 1.0)):
        raise InvalidRequest(
            "adapters",
            f"this DiT runs {fused.name} fused into its weights at weight 1.0 "
            f'(adapter_mode "fused"); a request may name only that, at weight 1.0',
        )
    if workflow.partition not in facts.partitions:
        raise InvalidRequest(
            "adapters",
            f"{adapter.name} targets {' and '.join(facts.partitions)}, not "
            f"{workflow.partition}, the partition {workflow.name} runs on",
        )


def resolve(params: common_pb2.GenerationParams, catalog: AdapterCatalog, default_steps: int) -> None:
    """Fill in place what a checked request left unset: each weight (0: 1.0), the fused adapter, then the steps and
    shifts, each from the first adapter (in request order) whose sidecar recommends it, else the default."""
    fused = catalog.fused
    if fused is not None and not params.adapters:
        params.adapters.add(name=fused.name)
    for adapter in params.adapters:
        adapter.weight = adapter.weight or 1.0
    recommended = [catalog.adapters[adapter.name].recommended for adapter in params.adapters]
    if not params.num_inference_steps:
        params.num_inference_steps = next((r.steps for r in recommended if r.steps), default_steps)
    for key, default in DEFAULT_SHIFTS.items():
        if not params.HasField(key):
            setattr(params, key, next((getattr(r, key) for r in recommended if getattr(r, key) is not None), default))
