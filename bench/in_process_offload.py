"""diffusers' own CPU offload for bench.e2e's in-process baseline, where the bf16 pipeline does not fit the card.

A user of diffusers on such a card turns offload on with diffusers' API, so the baseline does the same, nothing made
here: `model` is the modular pipeline's way (a `ComponentsManager` holding every model, `enable_auto_cpu_offload`:
each model moves to the device for its forward and others leave when memory runs short); `sequential` is
`apply_group_offloading` at leaf level on every model (each layer's weights copied in as it runs). The components
load on the host first: on the card they would not fit. The rows and the saved baseline name which ran.
"""

from __future__ import annotations

import torch

from h3serve.common.memory_plan.counts import AUDIO_VAE, GIB, TEXT_ENCODER, TRANSFORMER, VIDEO_VAE
from h3serve.common.processes import MEMINFO, read_meminfo

OFFLOADS = ("none", "model", "sequential")
DESCRIBED = {
    "none": "",
    "model": " with diffusers' model CPU offload (ComponentsManager.enable_auto_cpu_offload)",
    "sequential": " with diffusers' sequential CPU offload (apply_group_offloading, leaf level)",
}
LABELS = {"none": "in process", "model": "in proc+off", "sequential": "in proc+seq"}  # the table's 12 columns
# enable_auto_cpu_offload's memory_reserve_margin as diffusers 0.42.1 defaults it: the room it keeps free beside the
# model it moves in. With it the bf16 transformer at 768x1344x124 ran one H100 out of memory (the VAE stayed on the
# card beside it); a user raises it, so --offload-margin does.
DEFAULT_MARGIN = "3GB"


def described(offload: str, margin: str) -> str:
    """The offload as the rows and the baseline name it, with a margin other than diffusers' default."""
    if offload != "model" or margin == DEFAULT_MARGIN:
        return DESCRIBED[offload]
    return DESCRIBED[offload].replace(")", f", memory_reserve_margin {margin})")


def load_device(offload: str, device: str) -> str:
    """Where the components load: the host when offloaded (the hooks move them), else the device itself."""
    return device if offload == "none" else "cpu"


def released_weights_gib(dtype: str) -> float:
    """The weights of every model of the pipeline at the released sizes in `dtype`, as the host holds them before
    the hooks move any (the text encoder as the services count it, without its language-model head)."""
    models = (
        TRANSFORMER.bytes(dtype, False),
        TEXT_ENCODER.bytes(dtype, "none"),
        VIDEO_VAE.bytes(dtype),
        AUDIO_VAE.bytes(dtype),
    )
    return sum(models) / GIB


def refuse_a_small_host(offload: str, model_dir: str, dtype: str, meminfo: str = MEMINFO) -> None:
    """Offloaded, the full-size pipeline is built in host memory before any hook moves a model: where the host's
    available memory is less than its weights, SystemExit now with both figures, not the OOM killer minutes later."""
    if offload == "none" or not model_dir:  # no directory: the tiny preset
        return
    host, need = read_meminfo(meminfo), released_weights_gib(dtype)
    if host is not None and need > (have := host.available / GIB):
        raise SystemExit(
            f"bench.e2e: --in-process-offload {offload}: the pipeline's {dtype} weights ({need:.1f} GiB) load on the "
            f"host first, and it has {have:.1f} GiB available"
        )


def apply(pipe, offload: str, device: str, margin: str = DEFAULT_MARGIN) -> None:
    """Turn on `offload` over every model of `pipe` (a modular pipeline whose components are on the host). The hooks
    live on the models: the manager of `model` is not needed once they are set.

    SystemExit naming the option when diffusers refuses it on `device` (model offload asks the device for its free
    memory, which a CPU cannot answer)."""
    models = {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    try:
        if offload == "model":
            from diffusers.modular_pipelines import ComponentsManager

            manager = ComponentsManager()
            for name, model in models.items():
                manager.add(name, model)
            manager.enable_auto_cpu_offload(device=device, memory_reserve_margin=margin)
        elif offload == "sequential":
            from diffusers.hooks import apply_group_offloading

            for model in models.values():
                apply_group_offloading(model, onload_device=torch.device(device), offload_type="leaf_level")
    except NotImplementedError as exc:
        raise SystemExit(f"bench.e2e: --in-process-offload {offload}: diffusers refuses it on {device}: {exc}") from exc
