"""One rank of the DiT group: `python -m h3serve.services.dit.rank <DiTConfig as JSON>`, started by the group's
launcher (h3serve/services/dit/supervisor.py on one node, torchrun over several) with torchrun's environment.

Rank 0 of a first start on one node checks what no restart can fix (config_check.py). Rank 0 then opens the
gRPC port with health NOT_SERVING, so during a (re)start clients get "starting" with the reason instead of a
closed port. Every rank then waits its restart back-off, joins the compute and control groups, loads and prepares
the transformer, and rank 0 turns SERVING. A rank whose parent (the launcher) dies gets SIGKILL, so no rank
outlives its group or keeps its GPU memory.

SIGTERM / SIGINT is a stop, not a failure (the launcher sends it to restart the group after a
rank exited, or to shut the service down): rank 0 stops its server gracefully, the other ranks
follow it to the end of what it runs, and every rank exits 0, so torchrun counts a group stopped
that way as finished instead of restarting it. A rank answers the signal within seconds whatever
it is doing: the group's work runs on a thread, so the main thread is always free to take it, and
a follower waits at most FOLLOW_STOP_S for rank 0 to leave first. A broken group is reported where
it is seen, by the driver.
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from h3serve.common import logs, processes
from h3serve.common.config import DiTConfig
from h3serve.common.errors import describe
from h3serve.common.server import GRACE_SECONDS, set_serving, start_server
from h3serve.model.adapters import FUSED
from h3serve.runtime import compile_cache, fastpath, memory, quantised_store, random_full, weight_stream
from h3serve.runtime.fastpath import FastPath
from h3serve.runtime.models import DTYPES, ModelSource, own_memory
from h3serve.runtime.service import load_model_service
from h3serve.services.dit import adapters, config_check, parallel, warmup
from h3serve.services.dit.group import ControlPlane, Driver, GroupMember, RankInfo, follow
from h3serve.services.dit.launch import REFUSED_PREFIX, decode_config
from h3serve.services.dit.runner import SCHEDULERS, DenoiseRunner, partitions, served
from h3serve.services.dit.server import SERVICE_NAME, DiTServicer, GroupView
from h3serve.services.dit.supervisor import LAST_EXIT_ENV
from h3serve.v1 import dit_pb2, dit_pb2_grpc

log = logging.getLogger("h3serve.dit.rank")
MAX_BACKOFF_S = 30.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_WAIT_S = 1.0  # a group broken by rank 0 leaving: how long this rank's own stop signal may trail it
FOLLOW_STOP_S = GRACE_SECONDS + 5.0  # a follower told to stop waits at most this long for rank 0 to leave first


def backoff_seconds(config: DiTConfig, restart: int) -> float:
    return 0.0 if restart == 0 else min(MAX_BACKOFF_S, config.restart_backoff_s * 2 ** (restart - 1))


class Endpoint:
    """Rank 0's gRPC server: up from the start, SERVING only while the group is whole."""

    def __init__(self, config: DiTConfig, restart: int, last_exit: str = "") -> None:
        self.view = GroupView(state=start_state(config, restart, last_exit))
        self.view.info.restarts, self.view.info.max_restarts = restart, config.max_restarts
        # Denoise checks requests against them
        self.view.info.workflows.extend(flow.value for flow in served(config.workflows))
        servicer = DiTServicer(self.view, config)
        self.server, self.health = start_server(
            lambda s: dit_pb2_grpc.add_DiTServicer_to_server(servicer, s),
            [SERVICE_NAME],
            config.address,
            tls=(config.tls_cert, config.tls_key),
            serving=False,
            auth_token=config.auth_token,
        )
        self.finished = threading.Event()
        self.exit_code = 1
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)

    def start_group(self, config: DiTConfig, restart: int) -> None:
        try:
            member, info = join(config, 0, restart)
            if config.warmup:
                self.view.state = f"warming up {', '.join(config.warmup)}"
                info.warm_shapes.extend(dict.fromkeys(run.shape for run in warmup.warm_up(member, config)))
            quantised_store.before_serving(config.fp8_save, lambda state: setattr(self.view, "state", state))
        except BaseException as exc:
            log.error("rank 0 could not join the DiT group: %s", describe(exc))
            reason = compile_cache.set_aside_if_damaged(exc) or describe(exc, lines=1)
            self.broken(f"start-up failed on rank 0: {reason}")
            return
        self.ready(Driver(member, config.heartbeat_s, self.broken), info)

    def ready(self, driver: Driver, info: dit_pb2.DiTInfo) -> None:
        info.restarts, info.max_restarts = self.view.info.restarts, self.view.info.max_restarts
        info.workflows.extend(self.view.info.workflows)
        self.view.info, self.view.driver, self.view.state = info, driver, "serving"
        set_serving(self.health, [SERVICE_NAME], True)
        log.info("DiT group of %d rank(s) is serving", info.world_size)

    def broken(self, reason: str) -> None:
        self.view.state = f"failed: {reason}"
        set_serving(self.health, [SERVICE_NAME], False)
        self.finished.set()

    def _on_signal(self, signum, _frame) -> None:
        """Stop like every server: NOT_SERVING, then the RPCs in flight get the grace (a cancelled one ends at its
        next step). If the group broke meanwhile, the driver fails them with the reason."""
        self.exit_code = 0
        if self.view.driver is None:  # still joining: nothing in flight, nothing to wait for
            self.server.stop(0)
            os._exit(0)
        log.info("signal %d: stopping (grace %.0f s)", signum, GRACE_SECONDS)
        self.view.state = "stopping"
        set_serving(self.health, [SERVICE_NAME], False)
        self.finished.set()

    def wait_and_exit(self) -> None:
        """Block until the group breaks or a signal comes; let failed RPCs deliver their status; exit."""
        self.finished.wait()
        self.server.stop(GRACE_SECONDS).wait(GRACE_SECONDS + 1.0)
        logging.shutdown()
        os._exit(self.exit_code)  # the driver thread may sit in a collective that will never return


def start_state(config: DiTConfig, restart: int, last_exit: str) -> str:
    """DiTInfo.state while the group starts: a restart says which, and how the start before it ended (the launcher's
    words: the exit code or signal, and an OOM kill's figures), so a client sees why the DiT is not serving."""
    if restart == 0:
        return "starting"
    return f"restarting (restart {restart} of {config.max_restarts}" + (f"; after: {last_exit})" if last_exit else ")")


def join(config: DiTConfig, rank: int, restart: int) -> tuple[GroupMember, dit_pb2.DiTInfo]:
    """Everything between process start and the first request, on every rank."""
    time.sleep(backoff_seconds(config, restart))
    layout = parallel.Layout.from_config(config)
    device = parallel.rank_device(config.device)
    control = ControlPlane(parallel.init_groups(device, config.collective_timeout_s))
    flows = served(config.workflows)
    loaded = partitions(flows)
    # a transformer_file is read whole (FSDP2 shards it after the load, as with adapters or fp8)
    load = load_by_shard if parallel.loads_shards(config, layout) and not config.transformer_file else load_whole
    components, model, held = load(config, layout, device, loaded)
    member = GroupMember(
        control,
        DenoiseRunner(components, flows, held, device),
        device,
        config.attention_backend,
        config.max_math_tokens,
    )
    ranks = control.gather(RankInfo(rank, os.getpid(), socket.gethostname(), str(device)))
    info = dit_pb2.DiTInfo(
        model=model,
        attention_backend=config.attention_backend,
        world_size=layout.world_size,
        ulysses_degree=layout.ulysses_degree,
        ring_degree=layout.ring_degree,
        fsdp=layout.fsdp,
        compute_backend="nccl" if device.type == "cuda" else "gloo",
        partitions=loaded,
        **held.describe(),
        ranks=[dit_pb2.RankStatus(rank=r.rank, pid=r.pid, host=r.host, device=r.device) for r in ranks],
    )
    return member, info


def load_whole(config: DiTConfig, layout: parallel.Layout, device: torch.device, loaded: list[str]):
    """The whole transformer partitions on this rank (fp8 ones from the fp8 store when saved there), their adapters,
    then the fast path and the parallelism (or, with `offload = "group"`, the weights stay in host memory: streamed
    from the fp8 store's memory-mapped files with `fp8_cache_dir`, else pinned)."""
    grouped = config.offload == "group"
    home = "cpu" if grouped else str(device)
    source, dtype, fast = (
        ModelSource(config.model_dir or None, config.transformer_file),
        DTYPES[config.dtype],
        FastPath.of(config),
    )
    store = (
        quantised_store.QuantisedStore(Path(config.fp8_cache_dir), source.revision(), dtype, fastpath.FP8_LAYOUT)
        if config.fp8_cache_dir
        else None
    )
    streamed = grouped and store is not None
    if streamed:  # capped first: the partitions are quantised block by block on the GPU
        assert store is not None  # streamed
        memory.cap(config, device)
        stored = {partition: stored_or_built(store, source, partition, device) for partition in loaded}
    else:
        found = (
            {partition: store.load(partition, skeleton_of(source, partition, dtype)) for partition in loaded}
            if store
            else {}
        )
        stored = {partition: module for partition, module in found.items() if module is not None}
    built = [partition for partition in loaded if stored.get(partition) is None]
    released = [partition for partition in built if not source.from_file(partition)]
    components, model = load_model_service("dit", [*released, *SCHEDULERS], config.replace(device=home))
    for partition in set(built) - set(released):  # [dit] transformer_file (load_model_service reads [model] dir)
        components.update(source.load([partition], home, config.dtype))
        model.components.append(partition)
    model.model_revision = source.revision()  # the file's fingerprint in it
    for partition in set(loaded) - set(built):
        components[partition] = place_stored(stored[partition], home, grouped)
        model.components.append(partition)
    model.device = str(device)  # where it computes, also when the weights stay in host memory
    if grouped:  # loaded on the CPU, so load_model_service capped nothing: the GPU it streams to is capped here
        memory.cap(config, device)
    partitions = {partition: components[partition] for partition in loaded}
    saver = store if int(os.environ.get("RANK", "0")) == 0 else None  # the ranks' weights are equal: rank 0 saves
    held = quantise_then_adapt(config, fast, partitions, built, saver, layout)
    for transformer in partitions.values():
        base = base_tensors(transformer) if streamed else set()
        parallel.ready_model(transformer, fast, device, dtype, sequence_split=layout.world_size > 1)
        parallel.parallelize(transformer, layout, device)
        if streamed:  # kept on the module for its figures (the hooks hold it anyway)
            transformer.weight_stream = weight_stream.BlockStream(transformer, fastpath.FP8_LAYOUT.blocks, base, device)
        elif grouped:
            parallel.offload_groups(transformer, device)
    return components, model, held


def quantise_then_adapt(
    config: DiTConfig,
    fast: FastPath,
    partitions: adapters.Partitions,
    built: list[str],
    store: quantised_store.QuantisedStore | None,
    layout: parallel.Layout,
) -> adapters.Adapters:
    """fp8 the partitions built here and save them (rank 0), then install the adapters over the quantised base as
    unmerged low-rank branches, so the saved weights are the same whatever the adapters. A fused adapter is merged
    into the bf16 weights before quantisation instead (such a deployment has no fp8 store: config.py)."""
    fused = config.adapter_mode == FUSED
    held = adapters.install(config, partitions) if fused else None
    for partition in built:
        if fast.fp8:
            fastpath.quantize_fp8(partitions[partition])
        if store is None:
            continue
        if layout.fsdp:  # sharding replaces the whole weights: they are written first
            store.save(partition, partitions[partition])
        else:  # the served weights, written while the start goes on
            store.save_later(partition, partitions[partition])
    return held if held is not None else adapters.install(config, partitions)  # held: fused


def stored_or_built(
    store: quantised_store.QuantisedStore, source: ModelSource, partition: str, device: torch.device
) -> torch.nn.Module:
    """The partition from the fp8 store, quantised there block by block on `device` first if it is not saved yet:
    group offload streams its blocks from those files (h3serve/runtime/weight_stream.py)."""
    skeleton = skeleton_of(source, partition, store.dtype)
    build = quantised_store.Build(source.weights(partition), skeleton, device, fastpath.quantize_fp8)
    transformer = store.load_or_build(partition, build)
    if transformer is None:
        raise RuntimeError(
            f"{partition}: group offload streams the fp8 weights from fp8_cache_dir = "
            f"{str(store.directory)!r}, and they could not be saved there (the warning above says why)"
        )
    return transformer


def skeleton_of(source: ModelSource, partition: str, dtype: torch.dtype) -> Callable[[], torch.nn.Module]:
    """The partition on the meta device, as the fp8 store assigns and builds it."""
    return functools.partial(random_full.skeleton, source.weights(partition).factory, dtype)


def base_tensors(transformer: torch.nn.Module) -> set[int]:
    """The tensors the fp8 store assigned (every parameter and persistent buffer), by identity: adapters added later
    wrap the modules but keep these objects."""
    saved = set(transformer.state_dict())
    return {
        id(tensor) for name, tensor in [*transformer.named_parameters(), *transformer.named_buffers()] if name in saved
    }


def place_stored(transformer: torch.nn.Module, home: str, grouped: bool) -> torch.nn.Module:
    """A transformer assigned from the fp8 store (memory-mapped host tensors) where it is served from. Group offload
    streams or pins them itself; on the CPU they get memory of their own (models.own_memory)."""
    if grouped:
        return transformer
    if torch.device(home).type == "cpu":
        own_memory(transformer)
        return transformer
    weight_stream.move_to_device(transformer, torch.device(home))  # through pinned slots, not from pageable memory
    return transformer


def load_by_shard(config: DiTConfig, layout: parallel.Layout, device: torch.device, loaded: list[str]):
    """Only this rank's shards of the transformer partitions (parallel.loads_shards: no adapters here)."""
    components, model = load_model_service("dit", SCHEDULERS, config.replace(device=str(device)))
    source = ModelSource(config.model_dir)
    for partition in loaded:
        components[partition] = parallel.load_sharded(
            source.weights(partition), layout, FastPath.of(config), device, DTYPES[config.dtype]
        )
    model.components.extend(loaded)
    return components, model, adapters.install(config, {})


class Follower:
    """A rank above 0. Its work (join, then follow rank 0) runs on a thread, so the main thread takes a stop signal at
    once, whatever the work is blocked in (the store, weight loading, a collective).

    A stop before it follows ends the process at once. While it follows, it keeps following until rank 0 has left
    (the group breaks), at most FOLLOW_STOP_S: leaving first would break the collectives of a request rank 0 still
    runs, which the driver reports as a failed group. A stop exits 0; a broken group or a failed join exits 1."""

    def __init__(self, config: DiTConfig, rank: int, restart: int) -> None:
        self.config, self.rank, self.restart = config, rank, restart
        self.following = False
        self.stop_by: float | None = None  # set by a stop signal that came while following
        self.done = threading.Event()  # the work ended: the group broke or the join failed
        self.failure = ""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, _signum, _frame) -> None:
        if not self.following:
            os._exit(0)
        self.stop_by = self.stop_by or time.monotonic() + FOLLOW_STOP_S

    def _work(self) -> None:
        try:
            member, _ = join(self.config, self.rank, self.restart)
        except BaseException as exc:
            aside = compile_cache.set_aside_if_damaged(exc)
            self.failure = f"could not join the DiT group: {aside + '; ' if aside else ''}{describe(exc)}"
            self.done.set()
            return
        self.following = True
        try:
            follow(member)  # returns only by an exception: the group broke
        except BaseException as exc:
            self.failure = f"left the broken DiT group: {describe(exc, lines=1)}"
        self.following = False  # from now on a stop signal ends the process at once
        self.done.set()

    def run_and_exit(self) -> None:
        threading.Thread(target=self._work, name="dit-follow", daemon=True).start()
        while not self.done.wait(0.2):
            if self.stop_by is not None and time.monotonic() > self.stop_by:
                log.warning(
                    "rank %d: rank 0 did not leave within %.0f s of the stop signal; leaving first",
                    self.rank,
                    FOLLOW_STOP_S,
                )
                break
        if self.stop_by is None:
            time.sleep(STOP_WAIT_S)  # a break that is a stop: this rank's own signal may trail it (exit 0 then)
            log.error("rank %d %s", self.rank, self.failure)
        logging.shutdown()
        os._exit(0 if self.stop_by is not None else 1)


def refuse_unfixable(config: DiTConfig) -> None:
    """On one node, rank 0's first start checks what no restart can fix (config_check.py) before it opens its port;
    a refusal prints the reason and exits EXIT_REFUSED, which the launcher does not restart."""
    try:
        config_check.check(config)
    except config_check.REFUSALS as exc:
        print(f"{REFUSED_PREFIX}{exc}", file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(processes.EXIT_REFUSED)


def main(argv: list[str] | None = None) -> None:
    config = decode_config((sys.argv[1:] if argv is None else argv)[0])
    rank, restart = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    processes.set_parent_death_signal(signal.SIGKILL)  # torchrun's ranks; the supervisor sets it before exec too
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack
    logs.setup(f"dit[{rank}]")
    if rank == 0 and restart == 0 and config.nnodes == 1:
        refuse_unfixable(config)
    if rank == 0:
        endpoint = Endpoint(config, restart, os.environ.get(LAST_EXIT_ENV, ""))
        threading.Thread(target=endpoint.start_group, args=(config, restart), name="dit-join", daemon=True).start()
        endpoint.wait_and_exit()  # the main thread stays free, so a signal is handled even while joining
    Follower(config, rank, restart).run_and_exit()


if __name__ == "__main__":
    main()
