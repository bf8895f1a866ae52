"""The DiT's LoRA adapters: read and checked at start, resident in the transformer partitions, set per request.

Files are read by diffusers' `MiniMaxH3LoraLoaderMixin.lora_state_dict`, which converts the original MiniMax-H3
layouts to diffusers' module names, folds per-module `.alpha` scalars into the weights and turns a `__metadata__`
`alpha` into the peft config's `lora_alpha`, so every module runs at alpha / rank. Each file's keys are checked
against the partition it loads into (the first key that does not fit names the failure) before any is loaded, and
the DiT runs that check once at start on weightless (meta) partitions, before it loads anything (config_check.py).

Loading happens once, before the fast path, FSDP2 and compile (rank.py), in one of three ways:

- `Resident` (adapter_mode "unfused"): every adapter a peft adapter of its own; a request activates its own with
  `set_adapters(names, weights)` (scale = alpha / rank x weight), or `disable_lora()` for none. Nothing reloads.
- `Slots` (unfused with compile = true): peft's activate/scale calls change Python state a compiled block guards
  on, so each switch would recompile. Instead the partition holds `adapter_slots` always-active slots at the largest
  rank, covering every module any adapter targets, with their scalings as tensors (peft's
  `prepare_model_for_compiled_hotswap`); a request's adapters are copied into the slots (zero-padded; only when a
  slot's adapter changes) and their per-module scales written into those tensors (0 for a module an adapter does not
  target, and for an empty slot). The compiled graph never changes, so nothing recompiles.
- `Fused` (adapter_mode "fused"): the one adapter merged into the weights at start; every request runs it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch

from h3serve.common.config import AdapterSource, DiTConfig
from h3serve.model import adapters as rules
from h3serve.model.adapters import AdapterFacts
from h3serve.v1 import common_pb2

if TYPE_CHECKING:
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

Partitions = dict[str, "MiniMaxH3Transformer3DModel"]  # the transformer partitions a DiT holds, by name

log = logging.getLogger("h3serve.dit.adapters")
PREFIXES = ("transformer", "transformer_ref")  # the key prefixes diffusers gives, one per partition
FACTOR = re.compile(r"(?P<module>.+)\.(?P<factor>lora_A\.weight|lora_B\.weight|lora_B\.bias)")


class AdapterRefused(ValueError):
    """An adapter file the DiT cannot serve; the message names its `[dit] adapters` key and the reason."""


@dataclass(frozen=True)
class AdapterFile:
    """One adapter as diffusers reads it: keys `<prefix>.<module>.lora_A.weight` in diffusers' names."""

    name: str
    source: AdapterSource
    state_dict: dict[str, torch.Tensor]
    metadata: dict | None  # the peft config diffusers derived (a `__metadata__` alpha), if any
    routes: dict[str, str]  # key prefix -> the partition it loads into
    facts: AdapterFacts

    def part(self, prefix: str) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict.items() if k.startswith(f"{prefix}.")}


def read(name: str, source: AdapterSource, loaded: Sequence[str]) -> AdapterFile:
    """Read one `[dit] adapters` entry for a DiT holding the `loaded` partitions; AdapterRefused says why not."""
    from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin

    try:
        state_dict, metadata = MiniMaxH3LoraLoaderMixin.lora_state_dict(source.path, return_lora_metadata=True)
    except Exception as exc:  # diffusers' reason (a conversion it cannot do, a corrupt file) is the useful part
        raise AdapterRefused(f"adapters.{name}: {source.path}: diffusers cannot read it: {exc}") from exc
    routes = _routes(name, state_dict, loaded, source.transformer_ref)
    ranks = [t.shape[0] for k, t in state_dict.items() if k.endswith(".lora_A.weight")]
    facts = AdapterFacts(
        name,
        tuple(sorted(set(routes.values()))),
        max(ranks, default=0),
        _recorded_alpha(source.path, metadata),
        rules.read_sidecar(source.path),
    )
    return AdapterFile(name, source, state_dict, metadata, routes, facts)


def _routes(name: str, state_dict: dict, loaded: Sequence[str], into_ref: bool) -> dict[str, str]:
    """Where each key prefix goes, as `MiniMaxH3LoraLoaderMixin.load_lora_weights` routes it for a pipeline holding
    the `loaded` partitions: `transformer_ref.` keys to transformer_ref; `transformer.` keys to transformer, or to
    transformer_ref with load_into_transformer_ref (`transformer_ref = true`) or when only transformer_ref is loaded."""
    prefixes = [p for p in PREFIXES if any(k.startswith(f"{p}.") for k in state_dict)]
    if not prefixes:
        raise AdapterRefused(
            f"adapters.{name}: no key names a MiniMax-H3 module diffusers knows; its first keys are "
            f"{sorted(state_dict)[:3]}"
        )
    into = {
        "transformer_ref": "transformer_ref",
        "transformer": "transformer_ref" if into_ref or "transformer" not in loaded else "transformer",
    }
    routes = {prefix: into[prefix] for prefix in prefixes}
    missing = sorted({p for p in routes.values() if p not in loaded})
    if missing:
        raise AdapterRefused(
            f"adapters.{name}: it loads into {missing[0]}, which this DiT does not load (serve a "
            f"workflow that runs on it: [dit] workflows)"
        )
    if len(set(routes.values())) < len(routes):
        raise AdapterRefused(
            f"adapters.{name}: its transformer. and transformer_ref. keys would both load into "
            "transformer_ref (transformer_ref = true); drop that setting"
        )
    return routes


def _recorded_alpha(path: str, metadata: dict | None) -> float:
    """The training alpha the file records, for Info: its per-module `.alpha` scalars when they agree (diffusers
    folded them into the weights), else the `lora_alpha` diffusers read from its metadata; 0 when none or mixed."""
    from safetensors import safe_open

    with safe_open(path, "pt") as file:
        alphas = {float(file.get_tensor(key)) for key in file.keys() if key.endswith(".alpha")}
    if not alphas:
        alphas = {float(v) for k, v in (metadata or {}).items() if k.endswith(".lora_alpha")}
    return alphas.pop() if len(alphas) == 1 else 0.0


def check_fits(adapter: AdapterFile, partitions: Partitions) -> None:
    """AdapterRefused naming the first key (in sorted order) that is not a LoRA factor of a linear layer of the
    partition it loads into, with that layer's shape."""
    for prefix, partition in adapter.routes.items():
        linears = {name: m for name, m in partitions[partition].named_modules() if isinstance(m, torch.nn.Linear)}
        part = adapter.part(prefix)
        for key in sorted(part):
            problem = _misfit(key.removeprefix(f"{prefix}."), part, prefix, linears)
            if problem:
                raise AdapterRefused(
                    f"adapters.{adapter.name}: {adapter.source.path}: key {key!r} does not fit {partition}: {problem}"
                )


def _misfit(key: str, part: dict[str, torch.Tensor], prefix: str, linears: dict[str, torch.nn.Linear]) -> str:
    match = FACTOR.fullmatch(key)
    if match is None:
        return "not a LoRA factor (lora_A.weight, lora_B.weight or lora_B.bias)"
    module, factor = match["module"], match["factor"]
    linear = linears.get(module)
    if linear is None:
        return f"the partition has no linear layer {module!r}"
    down, up = part.get(f"{prefix}.{module}.lora_A.weight"), part.get(f"{prefix}.{module}.lora_B.weight")
    if down is None or up is None:
        return "lora_A.weight and lora_B.weight go together"
    if down.ndim != 2 or up.ndim != 2 or down.shape[0] != up.shape[1]:
        return f"lora_A {tuple(down.shape)} and lora_B {tuple(up.shape)} are not (rank, in) and (out, rank)"
    expected = {
        "lora_A.weight": (down.shape[0], linear.in_features),
        "lora_B.weight": (linear.out_features, down.shape[0]),
        "lora_B.bias": (linear.out_features,),
    }[factor]
    if tuple(part[f"{prefix}.{key}"].shape) != expected:
        return (
            f"shape {tuple(part[f'{prefix}.{key}'].shape)}, but {module} is a {linear.in_features} -> "
            f"{linear.out_features} linear layer, so it takes {expected}"
        )
    return ""


def read_all(config: DiTConfig, partitions: Partitions) -> list[AdapterFile]:
    """Every configured adapter, read and checked against `partitions` (loaded, or weightless for the launcher's
    check) before any is loaded: a peft layer replaces the linear layer the next file is checked against."""
    files = [read(name, source, list(partitions)) for name, source in sorted(config.adapters.items())]
    for adapter in files:
        check_fits(adapter, partitions)
    return files


def inject(adapter: AdapterFile, partitions: Partitions) -> None:
    """diffusers' own injection of the routed keys (as `load_lora_weights` does it), as the adapter's peft adapter."""
    from diffusers.loaders.lora_pipeline import _LOW_CPU_MEM_USAGE_DEFAULT_LORA
    from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin as Loader

    for prefix, partition in adapter.routes.items():
        kwargs = dict(
            adapter_name=adapter.name, metadata=adapter.metadata, low_cpu_mem_usage=_LOW_CPU_MEM_USAGE_DEFAULT_LORA
        )
        with _several_adapters():
            if partition == "transformer":
                Loader.load_lora_into_transformer(adapter.part(prefix), transformer=partitions[partition], **kwargs)
            else:
                Loader.load_lora_into_transformer_ref(
                    adapter.part(prefix), transformer_ref=partitions[partition], prefix=prefix, **kwargs
                )


@contextlib.contextmanager
def _several_adapters():
    """peft warns when a model gets a second adapter, which is the point here, and that an adapter over fp8 weights
    cannot be merged into them, which nothing here asks of it (fused adapters are merged before quantisation)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Already found a `peft_config` attribute", UserWarning)
        warnings.filterwarnings("ignore", "TorchaoLoraLinear was instantiated without", UserWarning)
        yield


Request = Sequence[common_pb2.Adapter]


def _weight(adapter: common_pb2.Adapter) -> float:
    return adapter.weight or 1.0  # 0 means 1.0 (GenerationParams.adapters)


class Resident:
    """Unfused and eager: each adapter a peft adapter of its own, activated per request."""

    max_per_request = 0

    def __init__(self, files: list[AdapterFile], partitions: Partitions) -> None:
        self.partitions = partitions
        for adapter in files:
            inject(adapter, partitions)
        self.adapted = {p for adapter in files for p in adapter.routes.values()}

    def apply(self, partition: str, adapters: Request) -> None:
        if partition not in self.adapted:
            return
        model = self.partitions[partition]
        if adapters:
            model.enable_lora()
            model.set_adapters([a.name for a in adapters], [_weight(a) for a in adapters])
        else:
            model.disable_lora()


@dataclass
class Factors:
    """One adapter's LoRA in one module, kept on the CPU: its factors and peft's scale (alpha / rank)."""

    down: torch.Tensor  # (rank, in)
    up: torch.Tensor  # (out, rank)
    scale: float


class Slots:
    """Unfused with compile: `count` slots per adapted partition, overwritten per request (module docstring)."""

    def __init__(self, files: list[AdapterFile], partitions: Partitions, count: int) -> None:
        if any(k.endswith(".lora_B.bias") for adapter in files for k in adapter.state_dict):
            raise AdapterRefused(
                "adapters: a LoRA with biases (lora_B.bias) cannot be switched in place; serve it with compile = false"
            )
        self.partitions, self.count, self.max_per_request = partitions, count, count
        self.factors: dict[str, dict[str, dict[str, Factors]]] = {}  # partition -> adapter -> module -> factors
        for adapter in files:
            for partition, modules in _extract(adapter, partitions).items():
                self.factors.setdefault(partition, {})[adapter.name] = modules
        # adapter name in each slot
        self.holding: dict[str, list[str | None]] = {partition: [None] * count for partition in self.factors}
        self.layers = {}
        for partition, adapters in self.factors.items():
            _add_slots(partitions[partition], adapters, count)
            self.layers[partition] = _lora_layers(partitions[partition])

    def apply(self, partition: str, adapters: Request) -> None:
        if partition not in self.factors:
            return
        _reshard(self.partitions[partition])  # an FSDP2 module left unsharded would not gather the slots written below
        layers = self.layers[partition]
        for i, slot in enumerate(_slot_names(self.count)):
            wanted = adapters[i] if i < len(adapters) else None
            factors = self.factors[partition][wanted.name] if wanted else {}
            if wanted and self.holding[partition][i] != wanted.name:
                for module, f in factors.items():
                    _write(layers[module].lora_A[slot].weight, _padded(f.down, 0, layers[module].r[slot]))
                    _write(layers[module].lora_B[slot].weight, _padded(f.up, 1, layers[module].r[slot]))
                self.holding[partition][i] = wanted.name
            for module, layer in layers.items():
                layer.scaling[slot].fill_(
                    factors[module].scale * _weight(wanted) if wanted is not None and module in factors else 0.0
                )

    def first(self, partition: str) -> list[str]:
        """The adapter slot 0 should hold before serving: the first loaded (in name order) that adapts `partition`
        (none if none does). The first request naming an adapter copies its factors in from host memory, zero-padded
        on the CPU: 2.4 GiB for a rank-128 LoRA, the likeliest part of the 0.4-0.6 s by which the first request's DiT
        exceeded the next ones' on one H100 (docs/deploy/single-h100.md)."""
        return list(self.factors.get(partition, {}))[:1]


def _slot_names(count: int) -> list[str]:
    return [f"slot{i}" for i in range(count)]


def _lora_layers(model: torch.nn.Module) -> dict:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def _extract(adapter: AdapterFile, partitions: Partitions) -> dict[str, dict[str, Factors]]:
    """The adapter's factors as read, in the dtype peft loaded them in (the values it holds, without copying them back
    from the device), with each module's scale as peft computes it (injected, read, removed again)."""
    inject(adapter, partitions)
    out: dict[str, dict[str, Factors]] = {}
    for prefix, partition in adapter.routes.items():
        model, part = partitions[partition], adapter.part(prefix)
        out[partition] = {
            module: _factors(part, prefix, module, layer, adapter.name)
            for module, layer in _lora_layers(model).items()
            if adapter.name in layer.lora_A
        }
        model.delete_adapters(adapter.name)
    return out


def _factors(part: dict[str, torch.Tensor], prefix: str, module: str, layer, name: str) -> Factors:
    dtype = layer.lora_A[name].weight.dtype  # peft casts what it loads to this: a float32 file to bf16 layers
    return Factors(
        part[f"{prefix}.{module}.lora_A.weight"].to(dtype),
        part[f"{prefix}.{module}.lora_B.weight"].to(dtype),
        float(layer.scaling[name]),
    )


def _add_slots(model: MiniMaxH3Transformer3DModel, adapters: dict[str, dict[str, Factors]], count: int) -> None:
    """`count` zero adapters at the largest rank over every module an adapter targets, active, scalings as tensors."""
    from peft.utils.hotswap import prepare_model_for_compiled_hotswap

    rank = max(f.down.shape[0] for factors in adapters.values() for f in factors.values())
    layers = _lora_layers(model)  # every targeted module is one: _extract injected and removed an adapter there
    modules = sorted({module for factors in adapters.values() for module in factors})
    names = _slot_names(count)
    for name in names:
        zeros = {}
        for module in modules:
            base = layers[module].get_base_layer()
            like = dict(dtype=base.weight.dtype, device=base.weight.device)
            zeros[f"{module}.lora_A.weight"] = torch.zeros(rank, base.in_features, **like)
            zeros[f"{module}.lora_B.weight"] = torch.zeros(base.out_features, rank, **like)
        with _several_adapters():
            model.load_lora_adapter(zeros, prefix=None, adapter_name=name, low_cpu_mem_usage=True)  # no init: zeros
    model.set_adapters(names, [1.0] * count)
    prepare_model_for_compiled_hotswap(model)  # scalings become tensors, written in place from now on
    for layer in _lora_layers(model).values():
        for name in names:
            layer.scaling[name].fill_(0.0)


def _padded(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`tensor` zero-padded along its rank dimension `dim` to the slot's rank."""
    pad = [0, 0] * (tensor.ndim - 1 - dim) + [0, size - tensor.shape[dim]]
    return torch.nn.functional.pad(tensor, pad)


@torch.no_grad()
def _write(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy `full` into a slot parameter in place: its local shard when FSDP2 sharded it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def _reshard(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class Fused:
    """The one adapter merged into the weights at its scale; requests change nothing."""

    max_per_request = 0

    def __init__(self, files: list[AdapterFile], partitions: Partitions) -> None:
        (adapter,) = files
        inject(adapter, partitions)
        for partition in set(adapter.routes.values()):
            partitions[partition].fuse_lora(lora_scale=1.0, adapter_names=[adapter.name])
            partitions[partition].unload_lora()

    def apply(self, partition: str, adapters: Request) -> None:
        """Nothing to switch: the weights hold the adapter."""


class Holder(Protocol):
    """How a rank holds its adapters (Resident, Slots or Fused)."""

    max_per_request: int  # adapters one request may name; 0: any loaded

    def apply(self, partition: str, adapters: Request) -> None: ...


class Adapters:
    """The adapters of one rank: what Info reports, and `apply` at the start of every request (every rank alike)."""

    def __init__(
        self, facts: Sequence[AdapterFacts] = (), mode: str = rules.UNFUSED, holder: Holder | None = None
    ) -> None:
        self.facts, self.mode, self.holder = list(facts), mode, holder

    def apply(self, partition: str, adapters: Request) -> None:
        if self.holder is not None:
            self.holder.apply(partition, adapters)

    def warm(self, partition: str) -> list[str]:
        """The adapters a warm-up of `partition` names, so that none is copied in under a request: with compiled slots,
        the first loaded (`Slots.first`); resident or fused adapters are in place already."""
        return self.holder.first(partition) if isinstance(self.holder, Slots) else []

    def describe(self) -> dict:
        """The DiTInfo fields."""
        return dict(
            adapters=[f.to_info() for f in self.facts],
            adapter_mode=self.mode,
            max_request_adapters=self.holder.max_per_request if self.holder else 0,
        )


def install(config: DiTConfig, partitions: Partitions) -> Adapters:
    """Load the configured adapters into the loaded `partitions`, before the fast path, FSDP2 and compile."""
    if not config.adapters:
        return Adapters(mode=config.adapter_mode)
    started = time.perf_counter()
    files = read_all(config, partitions)
    read_at = time.perf_counter()
    holder: Holder
    if config.adapter_mode == rules.FUSED:
        holder = Fused(files, partitions)
        facts = [replace(f.facts, fused=True) for f in files]
    else:
        holder = Slots(files, partitions, config.adapter_slots) if config.compile else Resident(files, partitions)
        facts = [f.facts for f in files]
    for f in facts:
        log.info(
            "adapter %s: rank %d, alpha %g, into %s, %s%s",
            f.name,
            f.rank,
            f.alpha,
            " and ".join(f.partitions),
            config.adapter_mode,
            " (slots: compiled)" if isinstance(holder, Slots) else "",
        )
    # what a start spends on them (docs/performance.md, "Warm start" reads it)
    log.info(
        "adapters read and checked in %.1f s, installed in %.1f s", read_at - started, time.perf_counter() - read_at
    )
    return Adapters(facts, config.adapter_mode, holder)
