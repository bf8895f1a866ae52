"""Which shipped deployment profile (docs/deploy/*.toml) serves a box fastest: `h3serve init`'s choice.

The profiles are taken as they ship, fastest first (`PROFILES`), never invented: each is set to the box (its card
as `[supervisor] gpu_memory_gib`, its host as `host_memory_gib`, the model directory) and must then
- have its GPUs: as many as its `gpus` settings name;
- have their compute capability: the oldest its kernels run on (`Profile.capability`, with the reason);
- fit the memory plan (h3serve/common/memory_plan.py) with a 5-second clip at its default canvas: every process
  within its GPU and cap, the host at start and while serving;
- have the disk for the quantised stores it streams from (the fp8 weights' size, from the plan's parameter counts);
  a store that only speeds a restart up is turned off, saying so, where the disk cannot also hold it;
- have the user's file where it needs one (a GGUF of the transformer).
The first that passes is chosen; every profile ahead of it says why it did not.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import h3serve
from h3serve.cli.box import Box
from h3serve.common.ceilings import SHORTEST, Ceilings
from h3serve.common.config import SERVICES, ConfigError, DeployConfig, load_deploy
from h3serve.common.memory_plan import GIB, TEXT_ENCODER, dit_weights, plan


@dataclass(frozen=True)
class Profile:
    name: str  # docs/deploy/<name>.toml
    capability: tuple[int, int]  # the oldest compute capability its kernels run on
    needs: str  # what that capability is for
    fast: str  # why it is the fastest of those after it, where it fits
    needs_gguf: bool = False  # [dit] transformer_file: the user's GGUF


# Fastest first. Capabilities: cuDNN's FP8 attention sm_90 (runtime/kernels/local.py), torchao's fp8 W8A8 sm_89,
# PyTorch's fused bf16 SDPA sm_80 (services/dit/attention.py), SageAttention sm_75 (runtime/kernels/sage.py).
PROFILES = (
    Profile(
        "h200x4",
        (8, 0),
        "bf16 fused attention (cuDNN SDPA)",
        "the DiT split over two GPUs (Ulysses 2: 1.85x a step on 2 x H200) and every stage on a GPU of its own, so "
        "one request's decode overlaps the next one's denoise",
    ),
    Profile(
        "single-h200",
        (9, 0),
        "FP8 attention (cudnn_fp8) and fp8 weights",
        "every stage resident on one card: fp8 weights, FP8 attention, compiled blocks, the bf16 encoder",
    ),
    Profile(
        "single-h100",
        (9, 0),
        "FP8 attention (cudnn_fp8) and fp8 weights",
        "the DiT resident in fp8 with FP8 attention and compiled blocks; the encoder's int8 layers streamed from host "
        "memory to leave the card to the DiT and the VAE",
    ),
    Profile(
        "single-32gb",
        (8, 9),
        "fp8 weights (torchao W8A8)",
        "the DiT's fp8 blocks streamed from host memory as they run, compiled; each stage on its share of the card",
    ),
    Profile(
        "single-24gb",
        (8, 9),
        "fp8 weights (torchao W8A8)",
        "the DiT's fp8 blocks streamed from host memory, the stages taking turns on the card",
    ),
    Profile(
        "single-24gb-gguf",
        (8, 0),
        "bf16 fused attention (PyTorch SDPA)",
        "the DiT from your GGUF, its quantised blocks streamed, the stages taking turns on the card",
        needs_gguf=True,
    ),
    Profile(
        "turing-4x22",
        (7, 5),
        "SageAttention (sm_75 has no fused bf16 attention)",
        "the DiT sharded over four small GPUs (FSDP2 + Ulysses 4) with SageAttention",
    ),
)


def shipped_directory() -> Path:
    """docs/deploy of the checkout h3serve runs from, else of the current directory."""
    beside = Path(h3serve.__file__).resolve().parents[1] / "docs" / "deploy"
    return beside if beside.is_dir() else Path.cwd() / "docs" / "deploy"


def set_key(text: str, section: str, key: str, literal: str, note: str) -> str:
    """`key = literal  # note` in [section] of a deployment's TOML text, every other line kept: the key's line replaced
    where [section] sets it, else added under its header (the section added at the end where there is none)."""
    lines, header = text.splitlines(), f"[{section}]"
    start = next((i for i, line in enumerate(lines) if line.strip() == header), None)
    setting = f"{key} = {literal}  # {note}"
    if start is None:
        return text.rstrip("\n") + f"\n\n{header}\n{setting}\n"
    end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
    found = next((i for i in range(start + 1, end) if re.match(rf"{re.escape(key)}\s*=", lines[i])), None)
    if found is None:
        lines.insert(start + 1, setting)
    else:
        lines[found] = setting
    return "\n".join(lines) + "\n"


def _literal(value: str | float) -> str:
    return f"{value:g}" if isinstance(value, float) else '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass(frozen=True)
class Verdict:
    profile: Profile
    text: str  # the profile set to the box
    why_not: tuple[str, ...]  # empty: it fits
    config: DeployConfig | None = None
    card_gib: float = 0.0  # the smallest of its GPUs
    notes: tuple[str, ...] = ()  # what was changed to fit the box, and why

    @property
    def fits(self) -> bool:
        return not self.why_not


def gpus_named(config: DeployConfig) -> int:
    """How many GPUs a deployment places its services on: up to the highest index its `gpus` settings name."""
    named = [
        int(gpu)
        for name in SERVICES
        if config.service(name).device.startswith("cuda")
        for gpu in config.service(name).gpus.split(",")
        if gpu.strip().isdigit()
    ]
    return max(named) + 1 if named else 1


def set_to_box(text: str, box: Box, card: float, model_dir: str, gguf: str) -> str:
    text = set_key(text, "supervisor", "gpu_memory_gib", _literal(card), "this box's card, as CUDA reports it")
    text = set_key(text, "supervisor", "host_memory_gib", _literal(box.host_gib), "this box's host memory")
    if model_dir:
        text = set_key(text, "model", "dir", _literal(model_dir), "the model directory")
    if gguf:
        text = set_key(text, "dit", "transformer_file", _literal(gguf), "your GGUF of the transformer")
    return text


def _load(text: str) -> DeployConfig:
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as file:
        file.write(text)
        file.flush()
        return load_deploy(file.name)


def assess(profile: Profile, box: Box, directory: Path, model_dir: str = "", gguf: str = "") -> Verdict:
    """Whether `profile` serves `box`, set to it; the reasons it does not."""
    shipped = (directory / f"{profile.name}.toml").read_text()
    if profile.needs_gguf and not gguf:
        return Verdict(profile, shipped, ("it serves the DiT from your GGUF: give --transformer-file",))
    needed = gpus_named(_load(shipped))
    if needed > len(box.gpus):
        placed = f"{needed} GPU{'s' if needed > 1 else ''}"
        return Verdict(profile, shipped, (f"it places its services on {placed}, the box has {len(box.gpus)}",))
    cards = box.gpus[:needed]
    oldest = min(gpu.capability for gpu in cards)
    if oldest < profile.capability:
        needed_sm, box_sm = (f"sm_{major}{minor}" for major, minor in (profile.capability, oldest))
        return Verdict(
            profile, shipped, (f"its {profile.needs} needs {needed_sm} or newer, the box's GPU is {box_sm}",)
        )
    card = min(gpu.memory_gib for gpu in cards)
    text = set_to_box(shipped, box, card, model_dir, gguf)
    try:
        config = _load(text)
    except ConfigError as exc:
        return Verdict(profile, text, (f"set to this box it does not load: {exc}",))
    result = plan(config, gpu_gib=card, frames=SHORTEST, host_gib=box.host_gib, host_source="the box")
    why_not = [f"a {SHORTEST}-frame clip at its default canvas: {problem}" for problem in result.problems]
    text, config, notes, short = fit_stores(text, config, box)
    return Verdict(profile, text, tuple(why_not + short), config, card, tuple(notes))


@dataclass(frozen=True)
class Store:
    """A quantised store of a deployment (h3serve/runtime/quantised_store.py) and the disk it fills."""

    section: str
    key: str
    directory: str
    what: str
    gib: float
    needed: bool  # the service reads its weights from the files (streamed), not only starts faster from them


def quantised_stores(config: DeployConfig) -> list[Store]:
    """The deployment's stores, those it streams from first, then the DiT's before the encoder's (its quantisation is
    the longer): `fit_stores` keeps them in this order while the disk holds them."""
    stores = []
    if config.dit.fp8_cache_dir:
        streamed = config.dit.offload == "group"
        fp8_gib = dit_weights(config.dit)[0] / GIB
        stores.append(Store("dit", "fp8_cache_dir", config.dit.fp8_cache_dir, "the DiT's fp8", fp8_gib, streamed))
    if config.encoder.int8_cache_dir:
        int8_gib = TEXT_ENCODER.bytes(config.encoder.dtype, "int8") / GIB
        directory = config.encoder.int8_cache_dir
        stores.append(Store("encoder", "int8_cache_dir", directory, "the encoder's int8", int8_gib, False))
    return sorted(stores, key=lambda store: not store.needed)


def fit_stores(text: str, config: DeployConfig, box: Box) -> tuple[str, DeployConfig, list[str], list[str]]:
    """`text` with each store the disk cannot also hold turned off (each only speeds a restart up: it is quantised at
    every start instead), the first ones kept first, with a note each; a reason the profile does not fit where the
    stores it streams from are more than the disk. A store's room is the free disk and what its directory already
    holds (a restart's files, reused); a store turned off leaves its files where they are."""
    kept: list[Store] = []
    notes: list[str] = []

    def fits(stores: list[Store]) -> bool:
        room = box.disk_gib + sum(min(box.held_gib(store.directory), store.gib) for store in stores)
        return sum(store.gib for store in stores) <= room

    for store in quantised_stores(config):
        if store.needed or fits([*kept, store]):
            kept.append(store)
            continue
        note = f"off: {store.what} store ({store.gib:.1f} GiB) does not fit this box's disk beside the rest"
        text = set_key(text, store.section, store.key, '""', note)
        notes.append(
            f"{store.key} off: {store.what} weights ({store.gib:.1f} GiB) do not fit the disk "
            f"({box.disk_gib:g} GiB free) beside the rest: quantised again at every start"
        )
    short = []
    if not fits(kept):
        takes = " and ".join(f"{store.what} {store.gib:.1f}" for store in kept)
        short.append(f"its quantised weights take {takes} GiB of disk, the box has {box.disk_gib:g} GiB free")
    return text, (_load(text) if notes else config), notes, short


def choose(box: Box, directory: Path, model_dir: str = "", gguf: str = "") -> list[Verdict]:
    """Every profile's verdict, fastest first, up to the first that fits (the last one, when any does)."""
    verdicts = []
    for profile in PROFILES:
        verdicts.append(assess(profile, box, directory, model_dir, gguf))
        if verdicts[-1].fits:
            break
    return verdicts


def costs(verdict: Verdict) -> list[str]:
    """What each request size costs on the chosen profile: per canvas, the planned GPU peak of a 5-second clip and
    the longest clip each workflow holds (the plan's ceilings, which the gateway admits by)."""
    assert verdict.config is not None
    ceilings = Ceilings(verdict.config, verdict.card_gib)
    out = []
    for height, width in ceilings.canvases():
        result = plan(verdict.config, gpu_gib=verdict.card_gib, canvas=(height, width), frames=SHORTEST, host_gib=0)
        peak = max(gpu.used for gpu in result.gpus) if result.gpus else 0.0
        held = ", ".join(
            f"{workflow} up to {frames} frames"
            if (frames := ceilings.ceiling(workflow, height, width).frames)
            else f"{workflow} refused"
            for workflow in verdict.config.dit.workflows
        )
        out.append(
            f"{height}x{width}: a {SHORTEST}-frame clip takes {peak:.1f} of {verdict.card_gib:g} GiB at its busiest "
            f"GPU (planned); {held}"
        )
    return out
