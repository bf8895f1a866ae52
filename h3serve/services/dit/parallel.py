"""How the transformer is spread over the group: FSDP2 weight sharding and diffusers' context parallelism.

`prepare_transformer` readies a transformer for serving, in this order: `ready_model`, the fast path
(h3serve/runtime/fastpath.py: attention backend, fp8, compile; context parallelism wraps the backend, so it must be
chosen first), then `parallelize`: weight sharding, then the sequence split (rank.load_whole calls the two itself,
to save fp8 weights between them). With FSDP2 a rank never holds the whole transformer where it can avoid it
(`loads_shards`): `load_sharded` readies it on the meta device and fills only this rank's shards
(h3serve/runtime/sharded_load.py). Every rank runs the same forward; the packed sequence is split after it is built
(diffusers' `_cp_plan`) and gathered at the output heads.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from h3serve.common.config import DiTConfig
from h3serve.runtime import fastpath, fp16_linears, pinned, random_full, sharded_load
from h3serve.runtime.fastpath import FastPath
from h3serve.runtime.offload import stream_from_host
from h3serve.services.dit import attention, gloo_shims

log = logging.getLogger("h3serve.dit.parallel")


@dataclass(frozen=True)
class Layout:
    """The parallel layout of the group, resolved from the config and checked once at start."""

    world_size: int
    ulysses_degree: int
    ring_degree: int
    fsdp: bool
    offload: bool = False  # fsdp_offload: FSDP2 keeps the shards in (pinned) host memory

    @classmethod
    def from_config(cls, config: DiTConfig) -> Layout:
        world = config.world_size
        if world < 1 or config.nnodes < 1 or world % config.nnodes:
            raise ValueError(f"world_size {world} must be a positive multiple of nnodes {config.nnodes}")
        ring = config.ring_degree or 1
        ulysses = config.ulysses_degree or world // ring
        if ulysses * ring != world:
            raise ValueError(f"ulysses_degree {ulysses} x ring_degree {ring} must equal world_size {world}")
        if ulysses > 1 and ring > 1:
            raise ValueError(
                "ulysses_degree and ring_degree both above 1 (hybrid) is not served: diffusers' hybrid "
                "mode needs the packed length divisible by the world size; use one of them"
            )
        fsdp = config.fsdp and world > 1
        return cls(world, ulysses, ring, fsdp, config.fsdp_offload and fsdp)

    @property
    def split(self) -> str:
        if self.world_size == 1:
            return "none"
        return f"ulysses {self.ulysses_degree}" if self.ulysses_degree > 1 else f"ring {self.ring_degree}"


def rank_device(config_device: str) -> torch.device:
    """This rank's device: its local GPU (LOCAL_RANK, from the launcher), else the configured device."""
    device = torch.device(config_device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return device


def init_groups(device: torch.device, timeout_s: float) -> dist.ProcessGroup:
    """The compute group (NCCL next to gloo on GPUs, gloo on CPU) and a gloo control group; returns the latter."""
    timeout = timedelta(seconds=timeout_s)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "cpu:gloo"  # "cpu" keeps diffusers off CUDA
    dist.init_process_group(
        backend,
        store=attempt_store(timeout),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    control = dist.new_group(backend="gloo", timeout=timeout)
    assert isinstance(control, dist.ProcessGroup)  # a group of all ranks: every rank is a member
    return control


def attempt_store(timeout: timedelta) -> dist.Store:
    """The launcher's store (h3serve's supervisor, or torchrun's agent), with keys private to this restart; a group
    of one rank has nobody to meet, so its store is in its own memory (the supervisor serves none).

    After a restart the ranks meet in the same store, where the dead attempt's keys (the old
    ranks' addresses) still lie: a new rank could read one and wait on a dead port.
    """
    if int(os.environ["WORLD_SIZE"]) == 1:
        return dist.HashStore()
    rank, restart = int(os.environ["RANK"]), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=rank == 0 and not agent_store,
        timeout=timeout,
    )
    return dist.PrefixStore(f"h3serve-dit/attempt-{restart}", store)


def loads_shards(config: DiTConfig, layout: Layout) -> bool:
    """Whether each rank loads only its shards (`load_sharded`): FSDP2 over a model directory or random:full.
    The tiny preset is built whole (a few kB, seeded as whole modules); adapters (peft injects and merges them)
    and fp8 (scales from the values) need the whole weights before sharding, so they load whole first."""
    return layout.fsdp and bool(config.model_dir) and not config.adapters and not config.fp8


def load_sharded(
    weights: sharded_load.Weights, layout: Layout, fast: FastPath, device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    """The transformer readied on the meta device, sharded, then only this rank's shards filled from `weights`
    (`fp16_scaled` linears and int8 weights converted on the skeleton, so no rank holds a bf16 copy of its rows)."""
    started = time.perf_counter()
    transformer = random_full.skeleton(weights.factory, dtype)
    changed = fastpath.convert_linears(transformer, fast)
    if changed:
        weights = fp16_linears.ConvertedRows(weights, changed)
    prepare_transformer(transformer, layout, fast, device, dtype, weights)
    log.info(
        "%s: this rank's shards, %.2f GiB, loaded in %.1f s",
        weights.label,
        sharded_load.shard_bytes(transformer) / 2**30,
        time.perf_counter() - started,
    )
    return transformer


def prepare_transformer(
    transformer,
    layout: Layout,
    fast: FastPath,
    device: torch.device,
    dtype: torch.dtype,
    weights: sharded_load.Weights | None = None,
) -> None:
    """After load (or on a meta-device skeleton with its `weights`), before the first request: the fast path
    (attention backend first), then the parallelism."""
    ready_model(transformer, fast, device, dtype, sequence_split=layout.world_size > 1)
    parallelize(transformer, layout, device, weights)


def ready_model(
    transformer, fast: FastPath, device: torch.device, dtype: torch.dtype, sequence_split: bool = False
) -> None:
    """The backend is checked on this device (the reason if it cannot run), then the fast path applied."""
    attention.check_model(transformer, fast.attention, device, dtype)
    fastpath.apply(transformer, fast, sequence_split)


def parallelize(transformer, layout: Layout, device: torch.device, weights: sharded_load.Weights | None = None) -> None:
    """Weight sharding (then, for a meta-device skeleton, this rank's shards filled from `weights`), then the
    sequence split (context parallelism wraps the backend already set)."""
    if layout.world_size == 1:
        return
    if device.type == "cpu":
        gloo_shims.apply()
    if layout.fsdp:
        shard_weights(transformer, device, layout.offload)
    if weights is not None:
        sharded_load.materialise(transformer, weights, device, layout.offload)
    split_sequence(transformer, layout)
    log.info(
        "transformer on %d ranks: %s, weights %s",
        layout.world_size,
        layout.split,
        ("sharded (FSDP2, offloaded to host)" if layout.offload else "sharded (FSDP2)")
        if layout.fsdp
        else "replicated",
    )


def shard_weights(transformer, device: torch.device, offload: bool = False) -> None:
    """FSDP2 per block (diffusers' `_no_split_modules`), then the root for the rest; with `offload` the shards
    stay in host memory (pinned for the copies to a GPU) and each block is gathered onto `device` as it runs.

    Inference only: with gradients off FSDP accepts the bf16 blocks next to the fp32-pinned
    projections in one root group, and a block's int8 weights beside their fp32 scales and fp32 norms
    (fp16_linears; it refuses mixed dtypes only for trainable parameters).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    transformer.requires_grad_(False)
    blocks = [m for m in transformer.modules() if type(m).__name__ in transformer._no_split_modules]
    for block in [*blocks, transformer]:
        fully_shard(block, mesh=mesh, offload_policy=policy)


def check_group_offload(device: torch.device) -> None:
    """ValueError unless `offload = "group"` has a GPU to stream the blocks to."""
    if device.type != "cuda":
        raise ValueError(
            f'offload = "group" streams the blocks from host memory to a GPU; this rank runs on '
            f'{device.type}, where the weights are in host memory already: set offload = "none"'
        )


def offload_groups(transformer, device: torch.device) -> pinned.Arenas:
    """One rank on a small GPU (`offload = "group"`): the weights stay in pinned host memory and each block is copied
    to `device` on a side stream while the one before it runs (h3serve/runtime/offload.py). Returns the pinned
    arenas that hold the weights."""
    check_group_offload(device)
    arenas = stream_from_host(transformer, device)
    log.info("weights pinned in host memory: %d arenas of %d MiB", arenas.count, pinned.ARENA_BYTES >> 20)
    return arenas


def split_sequence(transformer, layout: Layout) -> None:
    """Context parallelism over all ranks; the `*_anything` modes take any packed length and head count."""
    from diffusers import ContextParallelConfig

    if layout.ulysses_degree > 1:
        config = ContextParallelConfig(ulysses_degree=layout.ulysses_degree, ulysses_anything=True)
    else:
        config = ContextParallelConfig(ring_degree=layout.ring_degree, ring_anything=True)
    transformer.enable_parallelism(config=config)
    _split_attention_runs_eagerly()


def _split_attention_runs_eagerly() -> None:
    """The `*_anything` all-to-alls exchange their sizes first, which torch.compile cannot trace: under a
    compiled block, diffusers' context-parallel attention runs eagerly between the compiled parts."""
    import diffusers.models.attention_dispatch as dispatch

    split_attention = dispatch._templated_context_parallel_attention
    if not getattr(split_attention, "_h3serve_eager", False):
        eager = torch.compiler.disable(split_attention)
        eager._h3serve_eager = True
        dispatch._templated_context_parallel_attention = eager


def peak_memory_bytes(device: torch.device) -> int:
    """Peak since the last reset: allocated GPU memory, or on CPU the process's peak resident size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
