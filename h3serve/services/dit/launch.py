"""`h3serve serve dit`: check the configuration here, then become the group's launcher.

On one node the launcher is h3serve's own (h3serve/services/dit/supervisor.py): it starts the ranks,
serves their store on the DiT's host only, and restarts the group when a rank exits. Over several
nodes it is torchrun (torch.distributed.run) with a c10d rendezvous, which starts `world_size / nnodes`
ranks on each node and restarts them alike; its store listens on every interface, so the rendezvous
port must be firewalled to the nodes. Either restarts the group at most `max_restarts` times (each rank
waits its back-off first, h3serve/services/dit/rank.py). Errors that a restart cannot fix (the layout,
an unusable attention backend, an adapter file that does not fit the transformer) fail here, once, before any
rank starts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from h3serve.common.config import DiTConfig
from h3serve.model import presets
from h3serve.runtime import memory
from h3serve.runtime.fastpath import FastPath
from h3serve.runtime.models import DTYPES
from h3serve.services.dit import adapters, attention, parallel
from h3serve.services.dit.parallel import Layout
from h3serve.services.dit.runner import partitions, served

# Shared multi-GPU hosts: NVLink multicast off (docs: distributed-notes.md, NCCL notes).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def launcher_argv(config: DiTConfig) -> list[str]:
    """h3serve's launcher on one node, torchrun over several."""
    if config.nnodes == 1:
        return [sys.executable, "-m", "h3serve.services.dit.supervisor", encode_config(config)]
    return torchrun_argv(config)


def torchrun_argv(config: DiTConfig) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={config.world_size // config.nnodes}",
            f"--max-restarts={config.max_restarts}", f"--nnodes={config.nnodes}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={config.rdzv_endpoint}", f"--rdzv-id={config.rdzv_id}",
            "-m", "h3serve.services.dit.rank", encode_config(config)]


def encode_config(config: DiTConfig) -> str:
    """The resolved config as one JSON argument for every rank (checked again when a rank reads it)."""
    return config.model_dump_json()


def decode_config(text: str) -> DiTConfig:
    return DiTConfig.model_validate_json(text)


def transformer_shape(model_dir: str, partition: str) -> tuple[int, int]:
    """(attention heads, head dim) of the transformer partition that will be served."""
    if not model_dir:
        return presets.TINY_TRANSFORMER["num_attention_heads"], presets.TINY_TRANSFORMER["attention_head_dim"]
    if model_dir == presets.RANDOM_FULL:
        return presets.RELEASED_ATTENTION_SHAPE
    config = json.loads((Path(model_dir) / partition / "config.json").read_text())
    heads, head_dim = presets.RELEASED_ATTENTION_SHAPE
    return config.get("num_attention_heads", heads), config.get("attention_head_dim", head_dim)


def transformer_skeleton(model_dir: str, partition: str) -> torch.nn.Module:
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
    if config.adapters:
        adapters.read_all(config, {name: transformer_skeleton(config.model_dir, name) for name in loaded})
    FastPath.of(config)  # fp8 without bf16 is refused here
    device = torch.device(config.device)
    if device.type == "cuda":
        per_node, visible = config.world_size // config.nnodes, torch.cuda.device_count()
        if per_node > visible:
            raise ValueError(f"world_size {config.world_size} puts {per_node} ranks on this node, one per GPU, "
                             f"but {visible} GPU(s) are visible (gpus = {config.gpus!r})")
        for local_rank in range(per_node):  # each rank caps its allocator at start (runtime/service.py); a limit
            memory.fractions(config, torch.device("cuda", local_rank))  # above a card is refused here, once
        device = torch.device("cuda", device.index or 0)
    if config.offload == "group":
        parallel.check_group_offload(device)
    attention.check(config.attention_backend, *transformer_shape(config.model_dir, partition), device,
                    DTYPES[config.dtype], sequence_parallel=layout.world_size > 1, ring=layout.ring_degree > 1)
    return layout


def launch(config: DiTConfig) -> None:
    """Replace this process with the group's launcher, so signals reach it directly (and this process's memory,
    CUDA context included, is gone)."""
    try:
        check(config)
    except (ValueError, attention.BackendUnusable) as exc:
        raise SystemExit(f"h3serve serve dit: {exc}") from exc
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
    argv = launcher_argv(config)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)
