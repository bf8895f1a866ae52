"""Warm start: a compiled DiT denoises its [dit] warmup shapes before health says SERVING, and a request after that
compiles nothing (torch.compile's graph count, Info.compiled_graphs, stays put), whatever its prompt length, steps
or canvas. Real processes: the session stack's encoder and VAE, a DiT with compile = true and a gateway."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from deployments import QUICK_OUTAGE, write_config
from grpc_health.v1 import health_pb2, health_pb2_grpc

from h3serve.cli.launcher import ServiceGroup
from h3serve.cli.reference import ReferenceRequest, base_params, run_reference
from h3serve.client import GatewayClient
from h3serve.common.config import ConfigError, load_deploy
from h3serve.common.free_ports import free_port
from h3serve.runtime.models import ModelSource
from h3serve.v1 import common_pb2, dit_pb2, dit_pb2_grpc, gateway_pb2

pytestmark = pytest.mark.processes

WARM = dict(compile=True, warmup=["32x64x124"], warmup_steps=3, workflows=["t2va"])


@dataclass
class Warm:
    dit: dit_pb2_grpc.DiTStub
    client: GatewayClient
    group: ServiceGroup
    seen: list[tuple[str, int]]  # (Info.state, health) as the start went
    cache: Path  # [dit] compile_cache_dir


@pytest.fixture(scope="module")
def warm(stack, tmp_path_factory):
    """A warming DiT (compile, a compile cache of its own) and its gateway."""
    root = tmp_path_factory.mktemp("warm")
    ports = {**stack.ports, "dit": free_port(), "gateway": free_port()}
    config = write_config(
        root / "deploy.toml",
        str(stack.model_dir),
        root / "gateway",
        ports,
        dit={**WARM, "compile_cache_dir": str(root / "compile-cache")},
        outage_s=QUICK_OUTAGE,
    )
    group = ServiceGroup(load_deploy(config), str(config), log_dir=str(root), names=("dit", "gateway"))
    channel = grpc.insecure_channel(f"127.0.0.1:{ports['dit']}")
    dit = dit_pb2_grpc.DiTStub(channel)
    group.start()
    try:
        seen = watch_start(dit, health_pb2_grpc.HealthStub(channel))
        group.wait_healthy()
        client = GatewayClient(f"127.0.0.1:{ports['gateway']}")
        yield Warm(dit, client, group, seen, root / "compile-cache")
        client.close()
    finally:
        group.stop()
        channel.close()


def watch_start(dit, health, timeout: float = 300.0) -> list[tuple[str, int]]:
    """(Info.state, health status) as they change until the DiT says SERVING."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        # health first: the DiT says "serving" in Info before its health turns SERVING, so a state read after the
        # health is never older than it (read the other way round, a start seen as "warming up" while SERVING)
        try:
            status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
            state = dit.Info(common_pb2.InfoRequest(), timeout=5).state
        except grpc.RpcError:  # the port is not open yet
            time.sleep(0.1)
            continue
        if not seen or seen[-1] != (state, status):
            seen.append((state, status))
        if status == health_pb2.HealthCheckResponse.SERVING:
            return seen
        time.sleep(0.1)
    raise AssertionError(f"the DiT did not turn SERVING in {timeout} s: {seen}")


def info(dit) -> dit_pb2.DiTInfo:
    return dit.Info(common_pb2.InfoRequest(), timeout=10)


def test_the_dit_is_not_serving_until_its_warmup_shapes_have_run(warm):
    dit, seen = warm.dit, warm.seen
    warming = [status for state, status in seen if state == "warming up 32x64x124"]
    assert warming and set(warming) == {health_pb2.HealthCheckResponse.NOT_SERVING}, seen
    assert seen[-1] == ("serving", health_pb2.HealthCheckResponse.SERVING), seen
    started = info(dit)
    assert list(started.warm_shapes) == ["32x64x124"]
    assert started.compiled_graphs > 0, "compile = true: the warm-up compiled the blocks"
    assert started.compile_cache_hits == 0, "a fresh compile cache has nothing to load"
    assert (started.requests_served, started.steps_served) == (0, 0), "warm-ups are not requests"


@pytest.mark.parametrize(
    "prompt,height,width,steps",
    [
        ("a fox", 32, 64, 5),  # the warm shape, another prompt length and step count
        ("two otters float on a slow green river", 64, 32, 4),  # another canvas
    ],
)
def test_a_request_after_the_warmup_compiles_nothing_and_matches_the_pipeline(
    warm, tmp_path, prompt, height, width, steps
):
    dit, client = warm.dit, warm.client
    graphs, events = info(dit).compiled_graphs, []
    final = client.generate(
        gateway_pb2.GenerateRequest(
            prompt=prompt, height=height, width=width, num_inference_steps=steps, seed=3, include_raw=True
        ),
        events.append,
    )
    assert final.WhichOneof("kind") == "done", final
    assert info(dit).compiled_graphs == graphs, "the request compiled new graphs after the warm-up"
    assert [e.denoising.compiled_graphs for e in events if e.HasField("denoising")] == [0] * (steps - 1)
    assert_pipeline_frames(client, final, tmp_path, ReferenceRequest(prompt, height, width, 124, base_params(steps, 3)))


def assert_pipeline_frames(client: GatewayClient, final, tmp_path: Path, request: ReferenceRequest) -> None:
    """The job's raw frames are the in-process pipeline's for the same request."""
    served = np.load(client.download(final.done.raw.artifact_id, tmp_path / "raw.npz"))
    expected = run_reference(ModelSource(None), request)
    assert np.abs(served["frames"] - expected["frames"]).max() <= 1e-4  # compiled float32 against eager


def test_a_restart_loads_the_compiled_graphs_from_the_compile_cache(warm):
    assert list((warm.cache / "inductor").rglob("*")), "the warm-up left its graphs in compile_cache_dir"
    warm.group.restart("dit")
    restarted = info(warm.dit)
    assert list(restarted.warm_shapes) == ["32x64x124"]
    assert restarted.compile_cache_hits == restarted.compiled_graphs > 0, "every graph came from the cache"


def test_a_torn_compile_cache_is_set_aside_and_the_restart_compiles_afresh(warm, tmp_path):
    """Every file of the cache cut in half, as a rename no fsync made durable can leave one after a power loss (torch
    renames each file into place, so a kill alone tears none): the start that reads one fails, moves the cache aside
    saying so, and the launcher's restart compiles into an empty cache and serves what the pipeline computes."""
    for path in (p for p in warm.cache.rglob("*") if p.is_file()):
        with open(path, "r+b") as file:
            file.truncate(path.stat().st_size // 2)
    warm.group.restart("dit", signal.SIGKILL)
    restarted = info(warm.dit)
    assert restarted.compiled_graphs > 0 and restarted.compile_cache_hits == 0, "compiled afresh"
    aside = list(warm.cache.parent.glob(f"{warm.cache.name}.damaged-*"))
    assert len(aside) == 1 and list(warm.cache.rglob("*.py")), "the torn cache kept aside, a new one filled"
    log = (warm.cache.parent / "dit.log").read_text()
    assert f"the compile cache {warm.cache} could not be read: moved to {aside[0]}" in log
    final = warm.client.generate(
        gateway_pb2.GenerateRequest(prompt="a fox", height=32, width=64, num_inference_steps=3, seed=3, include_raw=1)
    )
    assert final.WhichOneof("kind") == "done", final
    assert_pipeline_frames(warm.client, final, tmp_path, ReferenceRequest("a fox", 32, 64, 124, base_params(3, 3)))


@pytest.mark.parametrize(
    "table,reason",
    [
        ('warmup = ["480x832"]', 'a shape is "HEIGHTxWIDTHxFRAMES"'),
        ('warmup = ["480x832x125"]', "must be 17n\\+5"),
        ('warmup = ["480x830x124"]', "width: must be a positive multiple of 32"),
        ('workflows = ["ref2va"]\nwarmup = ["480x832x124"]', "add t2va to workflows"),
    ],
)
def test_a_bad_warmup_is_refused_naming_the_key(tmp_path, table, reason):
    path = tmp_path / "bad.toml"
    path.write_text(f"[dit]\n{table}\n")
    with pytest.raises(ConfigError, match=reason) as err:
        load_deploy(path)
    assert "[dit] warmup" in str(err.value)


def test_a_start_slower_than_start_timeout_s_stops_the_group_and_names_the_setting(stack, tmp_path):
    ports = {**stack.ports, "dit": free_port(), "gateway": free_port()}
    config = write_config(tmp_path / "deploy.toml", str(stack.model_dir), tmp_path / "gateway", ports, dit=WARM)
    with open(config, "a") as file:
        file.write("\n[supervisor]\nstart_timeout_s = 2\n")  # a compiling warm-up takes longer on any machine
    group = ServiceGroup(load_deploy(config), str(config), log_dir=str(tmp_path), names=("dit",))
    with pytest.raises(TimeoutError, match=r"^not healthy after 2 s \(\[supervisor\] start_timeout_s\): dit$"):
        with group:
            pass
    assert group.running == []  # stopped, not left warming


def test_steps_that_compile_say_so_and_the_eta_leaves_them_out(stack, warm, tmp_path):
    ports = {**stack.ports, "dit": free_port(), "gateway": free_port()}
    config = write_config(
        tmp_path / "deploy.toml",
        str(stack.model_dir),
        tmp_path / "gateway",
        ports,
        # no warm-up; the graphs come from the warm DiT's cache (loading one counts as compiling it, and takes the
        # seconds of a cold compile from the suite)
        dit={"compile": True, "workflows": ["t2va"], "compile_cache_dir": str(warm.cache)},
        outage_s=QUICK_OUTAGE,
    )
    events = []
    with ServiceGroup(load_deploy(config), str(config), log_dir=str(tmp_path), names=("dit", "gateway")):
        with GatewayClient(f"127.0.0.1:{ports['gateway']}") as client:
            final = client.generate(
                gateway_pb2.GenerateRequest(prompt="a fox", height=32, width=64, num_inference_steps=6, seed=3),
                events.append,
            )
        with grpc.insecure_channel(f"127.0.0.1:{ports['dit']}") as channel:
            graphs = info(dit_pb2_grpc.DiTStub(channel)).compiled_graphs
    assert final.WhichOneof("kind") == "done", final
    steps = [e.denoising for e in events if e.HasField("denoising")]
    assert steps[0].compiled_graphs > 0, "the first forward compiles the blocks"
    assert steps[-1].compiled_graphs == 0, "by the last forward every variant is compiled"
    assert sum(s.compiled_graphs for s in steps) == graphs  # every graph the DiT built, reported by a step
    plain = []
    for step in steps:  # the ETA is the remaining steps at the mean of the steps that compiled nothing
        plain += [] if step.compiled_graphs else [step.step_seconds]
        if plain:
            assert step.eta_seconds == pytest.approx(sum(plain) / len(plain) * (step.total - step.step))
