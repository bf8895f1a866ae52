"""What no restart of the DiT group can fix: the layout, an unusable attention backend, a memory limit above the card,
an adapter file that does not fit the transformer, a start that needs more host memory than the host has available.
Checked once per start of the service, before anything loads:

- on one node by rank 0 of the first start, before it opens its port (rank.py): a refusal exits with
  `processes.EXIT_REFUSED` and the reason, and the launcher (supervisor.py) stops instead of restarting the group;
- over several nodes by `h3serve serve dit` before it execs torchrun (launch.py), which would restart any exit.

Rank 0 checks rather than the launcher because the check needs torch and diffusers: imported by the launcher
and again by every rank they put 21 s before the supervisor started, on an H200 host (docs/performance.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from h3serve.common.config import DiTConfig
from h3serve.model import presets
from h3serve.runtime import memory
from h3serve.runtime.fastpath import FastPath
from h3serve.runtime.models import DTYPES
from h3serve.runtime.service import check_host_memory
from h3serve.services.dit import adapters, attention, parallel, transformer_file
from h3serve.services.dit.parallel import Layout
from h3serve.services.dit.runner import partitions, served

if TYPE_CHECKING:
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

REFUSALS = (ValueError, attention.BackendUnusable)  # what `check` raises; AdapterRefused and MemoryLimitError too


def transformer_shape(model_dir: str, partition: str) -> tuple[int, int]:
    """(attention heads, head dim) of the transformer partition that will be served."""
    if not model_dir:
        return presets.TINY_TRANSFORMER["num_attention_heads"], presets.TINY_TRANSFORMER["attention_head_dim"]
    if model_dir == presets.RANDOM_FULL:
        return presets.RELEASED_ATTENTION_SHAPE
    config = json.loads((Path(model_dir) / partition / "config.json").read_text())
    heads, head_dim = presets.RELEASED_ATTENTION_SHAPE
    return config.get("num_attention_heads", heads), config.get("attention_head_dim", head_dim)


def transformer_skeleton(model_dir: str, partition: str) -> MiniMaxH3Transformer3DModel:
    """The partition's modules on the meta device (no weights, no memory): what adapter files are checked against."""
    from diffusers import MiniMaxH3Transformer3DModel as Transformer

    with torch.device("meta"):
        if not model_dir:
            return Transformer(**presets.TINY_TRANSFORMER)
        if model_dir == presets.RANDOM_FULL:
            return Transformer()
        return Transformer.from_config(Transformer.load_config(str(Path(model_dir) / partition)))


def check(config: DiTConfig) -> Layout:
    """Fail now, with the reason, on what no restart can fix."""
    layout = Layout.from_config(config)
    if config.nnodes > 1 and not config.rdzv_endpoint:
        raise ValueError("nnodes > 1 needs rdzv_endpoint (host:port of the c10d rendezvous)")
    loaded = partitions(served(config.workflows))
    partition = loaded[0]
    transformer_file.check(config)  # before the adapters are read against the transformer's shapes
    if config.adapters:
        adapters.read_all(config, {name: transformer_skeleton(config.model_dir, name) for name in loaded})
    FastPath.of(config)  # fp8 without bf16 is refused here
    device = torch.device(config.device)
    if device.type == "cuda":
        per_node, visible = config.world_size // config.nnodes, torch.cuda.device_count()
        if per_node > visible:
            raise ValueError(
                f"world_size {config.world_size} puts {per_node} ranks on this node, one per GPU, "
                f"but {visible} GPU(s) are visible (gpus = {config.gpus!r})"
            )
        for local_rank in range(per_node):  # each rank caps its allocator at start (runtime/service.py); a limit
            memory.fractions(config, torch.device("cuda", local_rank))  # above a card is refused here, once
        device = torch.device("cuda", device.index or 0)
    if config.offload == "group":
        parallel.check_group_offload(device)
    attention.check(
        config.attention_backend,
        *transformer_shape(config.model_dir, partition),
        device,
        DTYPES[config.dtype],
        sequence_parallel=layout.world_size > 1,
        ring=layout.ring_degree > 1,
    )
    check_host_memory("dit", config)  # this node's launcher and ranks; memory_plan.HostMemoryError is a ValueError
    return layout
