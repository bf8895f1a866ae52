"""Outages follow the supervisor (issue 29): `h3serve up`'s watch publishes each service's state to a file, stops a
start that has not served within [supervisor] start_timeout_s, and the gateway keeps a job waiting past its outage
limit while the file says the stage's service is coming back. The file for real; the watch over stand-in children
(real processes, the real health probe); the gateway's stage calls over real gRPC on loopback."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time

import grpc
import pytest
from stand_ins import SLEEP, StandIns, counted, deployment, health_server, meminfo, no_signals, starts

from h3serve.cli.supervise import Watch
from h3serve.common.config import GatewayConfig
from h3serve.common.free_ports import free_port
from h3serve.common.processes import Proc
from h3serve.common.supervision import (
    GIVEN_UP,
    RESTART_DUE,
    SERVING,
    STARTING,
    STATE_ENV,
    ServiceState,
    StateWriter,
    SupervisorState,
    read_live,
    write_atomically,
)
from h3serve.gateway.metrics import GatewayMetrics
from h3serve.gateway.stages import STAGE_NAMES
from h3serve.gateway.stages.calls import CallRecord, StageCaller, StageFailed
from h3serve.gateway.stages.stage import JobContext
from h3serve.gateway.stages.watchdog import Watchdog
from h3serve.v1 import encoder_pb2, encoder_pb2_grpc, gateway_pb2

pytestmark = pytest.mark.processes

OUTAGE_S = 0.3


def dead_process() -> Proc:
    """A process that has ended, as its pid and start time were while it ran."""
    process = subprocess.Popen([sys.executable, "-c", SLEEP])
    proc = Proc.of(process.pid)
    process.kill()
    process.wait()
    return proc


# The state file.


def test_a_live_writers_states_read_back_as_written(tmp_path):
    path = str(tmp_path / "supervisor.json")
    writer = StateWriter(path, start_timeout_s=300.0)
    starting = ServiceState(STARTING, since=1000.0, pid=4242, restart=True)
    writer.set("vae", ServiceState(RESTART_DUE, since=990.0, due=1000.0, reason="vae was killed by signal SIGKILL"))
    writer.set("dit", ServiceState(SERVING, since=900.0, pid=4141))
    writer.set("vae", starting)
    assert read_live(path) == SupervisorState(
        Proc.of(os.getpid()), 300.0, {"vae": starting, "dit": ServiceState(SERVING, since=900.0, pid=4141)}
    )


def test_a_file_whose_writer_has_ended_or_whose_pid_was_reused_is_not_read(tmp_path):
    path = str(tmp_path / "supervisor.json")
    services = {"vae": ServiceState(STARTING, since=time.time(), pid=1)}
    write_atomically(path, SupervisorState(dead_process(), 300.0, services).to_json())
    assert read_live(path) is None, "its writer has ended"
    write_atomically(path, SupervisorState(Proc(os.getpid(), "0"), 300.0, services).to_json())
    assert read_live(path) is None, "a live process has the pid, but it started at another time than the writer"
    write_atomically(path, SupervisorState(Proc.of(os.getpid()), 300.0, services).to_json())
    assert read_live(path) is not None


def test_no_file_or_a_file_that_does_not_parse_is_no_supervisor(tmp_path):
    assert read_live(str(tmp_path / "absent.json")) is None
    (tmp_path / "torn.json").write_text('{"writer": {"pid": 1')
    assert read_live(str(tmp_path / "torn.json")) is None


def test_a_write_replaces_the_file_whole_and_leaves_nothing_else(tmp_path):
    """A reader holding the file open while it is written reads the old version whole: the new one is a new file
    put in its place (an in-place rewrite would truncate what the reader reads)."""
    path = str(tmp_path / "supervisor.json")
    writer = StateWriter(path, start_timeout_s=300.0)
    writer.set("vae", ServiceState(SERVING, since=1.0, pid=7))
    with open(path) as held:
        writer.set("vae", ServiceState(RESTART_DUE, since=2.0, due=3.0, reason="x" * 10_000))
        old = SupervisorState.from_json(held.read())
    assert old.services["vae"].state == SERVING
    assert read_live(path).services["vae"].state == RESTART_DUE
    assert os.listdir(tmp_path) == ["supervisor.json"]


# The watch: every start is bounded by start_timeout_s, and each state change is published.


def recording(monkeypatch) -> list[tuple[str, ServiceState]]:
    """Every state the watch publishes, in order."""
    published, publish = [], StateWriter.set

    def record(self, name: str, state: ServiceState) -> None:
        published.append((name, state))
        publish(self, name, state)

    monkeypatch.setattr(StateWriter, "set", record)
    return published


def leaves_a_child(pids) -> str:
    """Code that starts a process of its own, writes its pid to `pids` and never serves."""
    return (
        "import subprocess, sys; "
        f"child = subprocess.Popen([sys.executable, '-c', {SLEEP!r}]); "
        f"open({str(pids)!r}, 'a').write(f'{{child.pid}}\\n'); {SLEEP}"
    )


def alive(pids) -> list[int]:
    pids = [int(line) for line in pids.read_text().split()] if pids.exists() else []
    return [pid for pid in pids if (proc := Proc.of(pid)) and proc.alive()]


def test_a_start_that_never_serves_is_stopped_with_its_tree_and_twice_ends_the_watch(tmp_path, capsys):
    pids = tmp_path / "children"
    group = StandIns(
        deployment(tmp_path, free_port(), start_timeout_s=2.0),
        {"vae": counted(tmp_path / "starts", leaves_a_child(pids))},
    )
    group.start()
    try:
        reason = Watch(group, no_signals(), meminfo(tmp_path / "meminfo", 16, 8.0)).run(lambda: None)
        assert group.running[0].process.returncode is not None, "the watch stopped it"
        assert alive(pids) == [], "and what it started"
    finally:
        group.stop()
    ended = "vae did not serve within 2 s of its start ([supervisor] start_timeout_s) and was stopped"
    assert reason == f"stopped restarting: the same start-up failure twice: {ended}"
    assert f"h3serve up: {ended}; restarting it in " in capsys.readouterr().err
    assert starts(tmp_path / "starts") == 2 and len(pids.read_text().split()) == 2


def test_a_restart_that_times_out_is_restarted_and_every_state_on_the_way_is_published(tmp_path, monkeypatch):
    port, count = free_port(), tmp_path / "starts"
    serves_second_time = counted(
        count, f"exec({SLEEP!r}) if len(open({str(count)!r}).read().splitlines()) == 1 else None; {health_server(port)}"
    )
    published = recording(monkeypatch)
    group = StandIns(deployment(tmp_path, port, start_timeout_s=2.0), {"vae": serves_second_time})
    group.supervisor_state = str(tmp_path / "supervisor.json")
    stop = no_signals()
    group.start()
    try:
        watch = Watch(group, stop, meminfo(tmp_path / "meminfo", 16, 8.0))
        assert watch.run(lambda: setattr(stop, "signum", 15)) is None, "served after one time-out"
        serving = group.running[0].process.pid
    finally:
        group.stop()
    kinds = [(state.state, state.restart) for _, state in published]
    assert kinds == [(STARTING, False), (RESTART_DUE, False), (STARTING, True), (SERVING, True)]
    assert published[1][1].reason.startswith("vae did not serve within 2 s of its start")
    assert published[2][1].pid == published[3][1].pid == serving
    live = read_live(group.supervisor_state)
    assert live.services == {"vae": published[3][1]} and live.start_timeout_s == 2.0


# The gateway: past the outage limit, a job waits while the supervisor says the service is coming back.

PROMPT = "a fox"
ABOUT_TO_START = "encoder was killed by signal SIGKILL"
COMING_BACK = {
    STARTING: (
        lambda: ServiceState(STARTING, since=time.time(), pid=4242, restart=True),
        r"encoder is restarting under h3serve up: started \d+ s ago \(pid 4242\), it has 300 s to serve "
        r"\(\[supervisor\] start_timeout_s\)",
    ),
    RESTART_DUE: (
        lambda: ServiceState(RESTART_DUE, since=time.time(), due=time.time() + 5, reason=ABOUT_TO_START),
        rf"encoder is restarting under h3serve up: {ABOUT_TO_START}; it starts again in \d s",
    ),
}


class Encoder(encoder_pb2_grpc.EncoderServicer):
    async def Encode(self, request, context):
        yield encoder_pb2.EncodeReply(summary=encoder_pb2.EncodeSummary(num_tokens=len(request.prompt)))


async def serve_encoder(port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    encoder_pb2_grpc.add_EncoderServicer_to_server(Encoder(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def encode_under(state_file: str | None, monkeypatch, serve_when=None):
    """One encoder call whose only replica is down (nothing listens on its port), `state_file` in STATE_ENV; the
    replica comes up when an event matches `serve_when`. Returns (the output or the StageFailed, the events)."""
    if state_file:
        monkeypatch.setenv(STATE_ENV, state_file)
    port, events, servers = free_port(), [], []
    config = GatewayConfig(
        encoder=f"127.0.0.1:{port}", retry_backoff_s=0.01, max_backoff_s=0.05, outage_s={"encoder": OUTAGE_S}
    )
    caller = StageCaller(config, GatewayMetrics(STAGE_NAMES))

    async def emit(**event):
        events.append(event["waiting"])
        if serve_when and re.fullmatch(serve_when, event["waiting"].reason) and not servers:
            servers.append(await serve_encoder(port))

    job = JobContext("job", gateway_pb2.ResolvedRequest(prompt=PROMPT), [], read_asset=None, emit=emit)
    try:
        return await caller.run(caller.stages["encoder"], job, CallRecord(), Watchdog({})), events
    except StageFailed as failed:
        return failed, events
    finally:
        await caller.close()
        for server in servers:
            await server.stop(None)


@pytest.mark.parametrize("state", COMING_BACK)
def test_a_call_waits_past_its_outage_limit_while_the_supervisor_brings_the_service_back(tmp_path, monkeypatch, state):
    make, said = COMING_BACK[state]
    path = str(tmp_path / "supervisor.json")
    StateWriter(path, start_timeout_s=300.0).set("encoder", make())  # this test is the live supervisor
    output, events = asyncio.run(encode_under(path, monkeypatch, serve_when=said))
    assert output.summary.num_tokens == len(PROMPT), output
    first, supervised = events
    assert first.reason.startswith("UNAVAILABLE: ") and first.limit_s == OUTAGE_S
    assert re.fullmatch(said, supervised.reason) and supervised.stage == "encoder", supervised
    assert 0 < supervised.limit_s <= 305, "the most its start may still take"


NOT_COMING_BACK = {
    "given up": lambda path: StateWriter(path, 300.0).set("encoder", ServiceState(GIVEN_UP, time.time(), reason="x")),
    "serving since before the outage": lambda path: StateWriter(path, 300.0).set(
        "encoder", ServiceState(SERVING, since=time.time() - 3600, pid=4242)
    ),
    "a writer that has ended": lambda path: write_atomically(
        path,
        SupervisorState(dead_process(), 300.0, {"encoder": ServiceState(STARTING, time.time(), pid=4242)}).to_json(),
    ),
    "no file": lambda path: None,
}


@pytest.mark.parametrize("case", NOT_COMING_BACK)
def test_the_outage_limit_decides_when_the_supervisor_is_not_bringing_the_service_back(tmp_path, monkeypatch, case):
    path = str(tmp_path / "supervisor.json")
    NOT_COMING_BACK[case](path)
    failed, events = asyncio.run(encode_under(path, monkeypatch))
    assert isinstance(failed, StageFailed) and failed.code == grpc.StatusCode.UNAVAILABLE, failed
    assert str(failed).endswith(f"no encoder replica took the call for {OUTAGE_S:g} s (its outage limit)")
    assert [event.reason.split(":")[0] for event in events] == ["UNAVAILABLE"], "told of the outage, nothing more"
