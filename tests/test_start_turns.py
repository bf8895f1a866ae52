"""Where the stages take turns on one card (`[gateway] stages_take_turns`), the model services start one at a time:
each once the one before it serves, under `h3serve up`'s watch and under a ServiceGroup's wait (the demo's, the
benches'); the gateway starts with the first. Without turns they start together. Stand-in children hold their
SERVING until the test opens their gate, so the order is seen, not timed. And a service `up` restarts has the card
to itself too: the tiny model's stack under `up`, a job held mid-denoise while the encoder is killed and restarted."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from dit_holding import HELD
from stand_ins import StandIns, meminfo, no_signals
from up_process import CLEAN_EXIT, Up, environment, wait_until

from h3serve.cli.supervise import Watch
from h3serve.client import GatewayClient
from h3serve.common.config import load_deploy
from h3serve.common.free_ports import free_port
from h3serve.common.supervision import STARTING, STATE_ENV, read_live
from h3serve.v1 import gateway_pb2

pytestmark = pytest.mark.processes

MODELS = ("encoder", "dit", "vae")
HELD_S = 1.0  # how long a test watches a service that must not start yet


def gated_server(port: int, gate: Path, log: Path, name: str) -> list[str]:
    """A child that writes its name to `log` at once, and serves gRPC health (SERVING) on `port` once `gate` exists."""
    code = (
        "import os, threading, time\n"
        "from h3serve.common.server import start_server\n"
        f"open({str(log)!r}, 'a').write({name!r} + '\\n')\n"
        f"while not os.path.exists({str(gate)!r}):\n"
        "    time.sleep(0.05)\n"
        f"server = start_server(lambda s: None, [], '127.0.0.1:{port}')\n"
        "threading.Event().wait()\n"
    )
    return [sys.executable, "-c", code]


class Stack:
    """Four stand-ins on free ports under a deployment with or without turns; `started()` lists them in start order,
    `open(name)` lets one serve."""

    def __init__(self, root: Path, turns: bool) -> None:
        self.root, self.log = root, root / "started"
        ports = {name: free_port() for name in (*MODELS, "gateway")}
        sections = "".join(f"[{name}]\nport = {port}\n\n" for name, port in ports.items() if name != "gateway")
        path = root / "deploy.toml"
        path.write_text(
            f"{sections}[gateway]\nport = {ports['gateway']}\nstages_take_turns = {str(turns).lower()}\n\n"
            "[supervisor]\nstop_grace_s = 5.0\nstart_timeout_s = 60.0\nfork_server = false\n"
        )
        commands = {name: gated_server(port, root / f"{name}.gate", self.log, name) for name, port in ports.items()}
        self.group = StandIns(load_deploy(str(path)), commands)

    def started(self) -> list[str]:
        """The model services started, in order, and the gateway last once it has (it starts beside the first)."""
        names = self.log.read_text().split() if self.log.exists() else []
        return [name for name in names if name != "gateway"] + [name for name in names if name == "gateway"]

    def open(self, name: str) -> None:
        (self.root / f"{name}.gate").touch()

    def held(self, started: list[str]) -> None:
        """Exactly `started` have started, and for HELD_S nothing more does (the next one waits for its turn)."""
        wait_until(lambda: self.started() == started, 30, f"{started} started")
        threading.Event().wait(HELD_S)
        assert self.started() == started

    def take_turns(self) -> None:
        """Let each model service serve in turn: the next one starts then and not before."""
        self.held(["encoder", "gateway"])
        for done, name in enumerate(MODELS[:-1], start=2):
            self.open(name)
            self.held([*MODELS[:done], "gateway"])


def beside(supervise: Callable[[], object], steps: Callable[[], None]) -> None:
    """`supervise` on this thread, the test's `steps` on another; what the steps raised is raised here. The
    supervisor spawns the services, so it keeps the main thread: a child forked from another thread of a busy process
    can hang before it runs (subprocess's preexec_fn, which the launcher's death signal uses, is not thread-safe)."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            steps()
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        supervise()
    finally:
        thread.join()
        if failed:  # the cause, also of a supervisor that then timed out
            raise failed[0]


def test_with_turns_up_starts_each_model_service_once_the_one_before_it_serves(tmp_path):
    stack = Stack(tmp_path, turns=True)
    stack.group.start()
    stop, healthy = no_signals(), threading.Event()
    watch = Watch(stack.group, stop, meminfo(tmp_path / "meminfo", 16, 8.0))

    def steps() -> None:
        try:
            stack.open("gateway")
            stack.held(["encoder", "gateway"])
            assert set(watch.states.services) == {"encoder", "gateway"}, "one waiting for its turn is not starting"
            stack.take_turns()
            assert watch.states.services["vae"].state == STARTING
            assert not healthy.is_set(), "up says it serves only once every service does"
            stack.open("vae")
            assert healthy.wait(30)
        finally:
            stop.signum = signal.SIGTERM

    try:
        beside(lambda: watch.run(healthy.set), steps)
        assert [item.name for item in stack.group.running] == [*MODELS, "gateway"], "a stop goes in reverse of this"
    finally:
        stack.group.stop()


def test_with_turns_a_service_groups_wait_starts_them_one_at_a_time(tmp_path):
    stack = Stack(tmp_path, turns=True)
    stack.group.start()
    healthy = threading.Event()

    def steps() -> None:
        stack.take_turns()
        assert not healthy.is_set()
        stack.open("vae")
        stack.open("gateway")

    try:
        beside(lambda: (stack.group.wait_healthy(), healthy.set()), steps)
        assert sorted(stack.started()) == sorted([*MODELS, "gateway"])
    finally:
        stack.group.stop()


def test_without_turns_every_service_starts_at_once(tmp_path):
    stack = Stack(tmp_path, turns=False)
    stack.group.start()
    try:
        wait_until(lambda: sorted(stack.started()) == sorted([*MODELS, "gateway"]), 30, "all four started")
        assert not stack.group.waiting
    finally:
        stack.group.stop()


def test_under_up_a_stage_call_waits_for_the_card_while_a_restarted_service_starts(tmp_path, dit_hold, tiny_model_dir):
    """The job's decode comes while the encoder `up` restarted is starting: its call waits for the card until the
    encoder serves, and the job is told so; then it succeeds."""
    up = Up(tmp_path, tiny_model_dir, {}, "[supervisor]\nbackoff_s = 0.5\n", {"stages_take_turns": True})
    try:
        up.wait_serving()
        state_file = environment(up.service("gateway"))[STATE_ENV]
        with GatewayClient(f"127.0.0.1:{up.ports['gateway']}") as client, dit_hold.armed():
            job = client.submit(gateway_pb2.GenerateRequest(prompt="a heron on one leg", **HELD))
            events = client.events(job.job_id)
            next(event for event in events if dit_hold.holds(event))
            old = up.service("encoder")
            os.kill(old, signal.SIGKILL)
            wait_until(lambda: _state(state_file, "encoder") == (STARTING, True), 30, "the encoder restarting")
            dit_hold.release()
            rest = list(events)
        assert rest[-1].HasField("done"), rest[-1]
        waits = [(event.waiting.stage, event.waiting.reason) for event in rest if event.HasField("waiting")]
        told = "the card is encoder's while it starts: encoder is restarting under h3serve up: started "
        assert [stage for stage, reason in waits if reason.startswith(told)] == ["vae"], waits
        up.process.send_signal(signal.SIGTERM)
        assert up.end() == CLEAN_EXIT, up.output.read_text()[-2000:]
    finally:
        up.close()


def _state(path: str, name: str) -> tuple[str, bool] | None:
    live = read_live(path)
    service = live.services.get(name) if live else None
    return (service.state, service.restart) if service else None
