"""Supervision for real: `h3serve up` as a subprocess (stops, restarts, its own death) and the DiT's own launcher
(its store's address, a rank's death, its own death and stop); processes are killed for real.

Where the behaviour is the supervisors' own, their children are stand-ins that load no model and start in well under
a second: `h3serve up` itself runs over gRPC health servers (tests/stand_in_up.py), the DiT among them as the
launcher's Group over stand-in ranks (tests/stand_in_dit_launcher.py), which also serves the DiT launcher's tests of
a rank's and its own death. The tiny model runs where the behaviour is the services': a job waiting for a VAE that
`up` restarts, the ranks' rendezvous and store, and their stop."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from deployments import write_config
from stand_in_dit_launcher import stand_in_launcher
from stand_ins import health_server
from up_process import (
    CLEAN_EXIT,
    CLI,
    SMALL,
    Ended,
    Up,
    environment,
    eventually,
    kill_tree,
    living,
    own_environment,
    wait_until,
)

from h3serve.cli.serve import ALLOCATOR_SETTING
from h3serve.client import GatewayClient
from h3serve.common.free_ports import free_port
from h3serve.common.processes import Proc, children, descendants
from h3serve.common.server import is_serving
from h3serve.v1 import common_pb2, dit_pb2_grpc, gateway_pb2

pytestmark = pytest.mark.processes

STAND_IN_UP = Path(__file__).with_name("stand_in_up.py")
DIT2 = dict(world_size=2, heartbeat_s=1.0, restart_backoff_s=0.5, max_restarts=5, collective_timeout_s=30.0)
# The stand-ins are plain `python -c` processes, which no fork server forks (each would be refused and spawned): `up`
# over them starts none, instead of importing the model's packages for nothing.
SUPERVISOR = "[supervisor]\nmax_restarts = 1\nbackoff_s = 0.5\nstop_grace_s = 30.0\nfork_server = false\n"


def stand_in(name: str, port: int) -> list[str]:
    """Service `name`'s stand-in, named `serve <name>` in its argv, where Up.service looks for a service."""
    command = stand_in_launcher(port) if name == "dit" else [sys.executable, "-c", health_server(port)]
    return [*command, "serve", name]


class StandInUp(Up):
    """`h3serve up` as from a terminal (Up), run by tests/stand_in_up.py over stand-ins, which read nothing of the
    deployment file but their ports."""

    def program(self) -> list[str]:
        commands = {name: stand_in(name, port) for name, port in self.ports.items()}
        return [sys.executable, str(STAND_IN_UP), json.dumps(commands)]


@pytest.fixture
def up(tmp_path):
    started = StandInUp(tmp_path, Path(), {}, SUPERVISOR)
    try:
        started.wait_serving()
        yield started
    finally:
        started.close()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_ends_up_and_every_process_it_started(up, signum):
    assert len(up.collect()) >= 6, "encoder, the DiT's launcher and 2 ranks, vae, gateway"
    if signum == signal.SIGINT:
        os.killpg(up.process.pid, signum)  # Ctrl-C: the terminal signals its foreground process group
    else:
        up.process.send_signal(signum)
    assert up.end() == CLEAN_EXIT, up.output.read_text()[-2000:]
    assert up.output.read_text().rstrip().endswith("stopping")


def test_a_stop_right_after_a_service_died_ends_everything(up):
    up.collect()
    os.kill(up.service("vae"), signal.SIGKILL)
    up.process.send_signal(signal.SIGTERM)
    assert up.end() == CLEAN_EXIT, up.output.read_text()[-2000:]


def test_up_restarts_a_killed_service_and_gives_up_past_its_budget(up):
    """That the restarted services serve jobs again is the fault walk's (test_fault_walk.py: the DiT's launcher, the
    VAE, each killed mid-job under `h3serve up`, every job succeeds) and the VAE's below."""
    for name in ("vae", "dit"):
        old = Proc.of(up.service(name))
        ranks = {proc for proc in map(Proc.of, descendants(old.pid)) if proc}
        os.kill(old.pid, signal.SIGKILL)
        wait_until(lambda name=name, old=old: up.service(name) not in (None, old.pid), 30, f"{name} started again")
        assert not living(ranks), "the DiT's ranks ended with their launcher"
        up.wait_serving()
        assert f"{name} was killed by signal SIGKILL; restarting it" in up.output.read_text()
    os.kill(up.service("vae"), signal.SIGKILL)  # [supervisor] max_restarts = 1: this exit is one too many
    assert up.end() == Ended(1, [], []), up.output.read_text()[-2000:]
    assert "vae was killed by signal SIGKILL, past its restart budget" in up.output.read_text()


def test_kill_9_of_up_ends_every_service_within_seconds(up):
    procs = up.collect()
    up.process.kill()
    up.process.wait()
    assert eventually(lambda: not living(procs), 10), f"services outlived up: {living(procs)}"


# The VAE's restart waits 4 s before it even starts: well past the vae's outage limit of 1 s.
SLOW_VAE_RESTART = "[supervisor]\nbackoff_s = 4.0\n\n[gateway.outage_s]\nvae = 1.0\n"


def test_a_job_waits_past_its_outage_limit_for_the_vae_up_is_restarting(tmp_path, tiny_model_dir):
    """The field report: a VAE restarted by `up` took longer to serve than the decode's outage limit, and a job failed
    UNAVAILABLE while `up` was bringing it back. Here the job is told why it waits, and succeeds."""
    up = Up(tmp_path, tiny_model_dir, {}, SLOW_VAE_RESTART)
    try:
        up.wait_serving()
        with GatewayClient(f"127.0.0.1:{up.ports['gateway']}") as client:
            job = client.submit(gateway_pb2.GenerateRequest(**SMALL))
            os.kill(up.service("vae"), signal.SIGKILL)  # the job has just been queued: its decode is to come
            events = list(client.events(job.job_id))
        assert events[-1].HasField("done"), events[-1]
        waits = [(event.waiting.stage, event.waiting.reason) for event in events if event.HasField("waiting")]
        assert waits[0][1].startswith("UNAVAILABLE: "), waits
        assert any(
            stage == "vae" and reason.startswith("vae is restarting under h3serve up: ") for stage, reason in waits[1:]
        ), waits
        assert "vae was killed by signal SIGKILL; restarting it in 4.0 s" in up.output.read_text()
        up.process.send_signal(signal.SIGTERM)  # the real services' stop: no ERROR or Traceback in their logs
        assert up.end() == CLEAN_EXIT, up.output.read_text()[-2000:]
    finally:
        up.close()


# The DiT's own launcher: `h3serve serve dit` with nnodes = 1.

LISTEN, ESTABLISHED = "0A", "01"


def sockets(pid: int, state: str) -> list[tuple[tuple[str, int], tuple[str, int]]]:
    """(local, remote) (address, port) of process `pid`'s TCP sockets in `state`, from /proc/net/tcp and tcp6."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            inodes |= set(re.findall(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}")))
        except OSError:  # closed meanwhile
            pass
    rows = [
        line.split()
        for table in ("/proc/net/tcp", "/proc/net/tcp6")
        for line in Path(table).read_text().splitlines()[1:]
    ]
    return [(endpoint(row[1]), endpoint(row[2])) for row in rows if row[3] == state and row[9] in inodes]


def endpoint(text: str) -> tuple[str, int]:
    """A /proc/net address: 4 bytes (IPv4) or 16 (IPv6) in 32-bit words of host (little-endian) order, a hex port."""
    hexed, port = text.split(":")
    raw = b"".join(bytes.fromhex(hexed[i : i + 8])[::-1] for i in range(0, len(hexed), 8))
    return str(ipaddress.ip_address(raw)), int(port, 16)


class DiT:
    """A DiT launcher of 2 ranks, its output in dit.log: `h3serve serve dit` on the tiny model, or (`stand_in`) the
    launcher's Group over stand-in ranks."""

    def __init__(self, root: Path, stand_in: bool = False) -> None:
        self.port, self.log = free_port(), root / "dit.log"
        command = stand_in_launcher(self.port) if stand_in else [*CLI, "serve", "dit", "--config", self._config(root)]
        with open(self.log, "wb") as out:
            # its own environment: its ranks are its children, whose /proc environment is theirs
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=own_environment())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.seen: set[Proc] = set()

    def _config(self, root: Path) -> str:
        ports = {"encoder": 1, "dit": self.port, "vae": 2, "gateway": 3}
        return str(write_config(root / "deploy.toml", "", root / "gateway", ports, dit=DIT2))

    def ranks(self, count: int = 2, restart: int | None = None) -> dict[int, int]:
        """Rank -> pid of the current start (restart `restart`, if given), once all `count` ranks run."""

        def started():
            envs = {pid: environment(pid) for pid in children(self.process.pid)}
            found = {
                int(env["RANK"]): pid
                for pid, env in envs.items()
                if "RANK" in env and restart in (None, int(env["TORCHELASTIC_RESTART_COUNT"]))  # once exec'd
            }
            return found if len(found) == len(envs) == count else None

        ranks = wait_until(started, 60, "the ranks started", poll_s=0.02)
        self.seen |= {Proc.of(pid) for pid in ranks.values()} - {None}
        return ranks

    def info(self):
        return dit_pb2_grpc.DiTStub(self.channel).Info(common_pb2.InfoRequest(), timeout=10)

    def serving(self, restarts: int | None = None, limit_s: float = 120.0):
        """Info once the group serves (after restart `restarts`, if given)."""

        def ready():
            assert self.process.poll() is None, self.log.read_text()
            try:
                info = self.info()
            except grpc.RpcError:
                return None
            return info if info.state == "serving" and restarts in (None, info.restarts) else None

        return wait_until(ready, limit_s, f"the group serving (restart {restarts})")

    def health_serving(self) -> None:
        """Until rank 0 says SERVING on the DiT's port, as the launcher probes it (a stand-in rank has no Info)."""
        wait_until(lambda: is_serving(f"127.0.0.1:{self.port}"), 30, "rank 0 serving", poll_s=0.05)

    def starting_ranks(self) -> dict[int, int]:
        """The ranks of a start that has not joined yet: the current one, or after a SIGKILL the next one."""
        ranks = self.ranks()
        with contextlib.suppress(grpc.RpcError):
            if {rank.pid for rank in self.info().ranks} == set(ranks.values()):  # these have joined
                os.kill(ranks[1], signal.SIGKILL)
                wait_until(
                    lambda: not set(children(self.process.pid)) & set(ranks.values()),
                    30,
                    "the old ranks end",
                    poll_s=0.02,
                )
                ranks = self.ranks()
        return ranks

    def close(self) -> None:
        self.channel.close()
        kill_tree(self.process, self.seen)


@pytest.fixture(scope="module")
def dit(tmp_path_factory):
    """One DiT launcher of 2 ranks for the tests below; the last one stops it."""
    group = DiT(tmp_path_factory.mktemp("dit-launcher"))
    try:
        yield group
    finally:
        group.close()


@pytest.mark.distributed
@pytest.mark.parametrize("hung", [0, 1])
def test_a_rank_waiting_in_the_rendezvous_stops_at_once_on_sigterm(dit, hung):
    ranks = dit.starting_ranks()
    os.kill(ranks[hung], signal.SIGSTOP)  # it never joins: the other rank waits in the rendezvous
    waiting = Proc.of(ranks[1 - hung])
    store_port = int(environment(waiting.pid)["MASTER_PORT"])
    wait_until(
        lambda: any(remote[1] == store_port for _, remote in sockets(waiting.pid, ESTABLISHED)),
        60,
        "the rank reached the store",
        poll_s=0.05,
    )
    time.sleep(0.5)
    os.kill(waiting.pid, signal.SIGTERM)
    assert eventually(lambda: not waiting.alive(), 3, poll_s=0.02), "the waiting rank outlived SIGTERM by 3 s"
    os.kill(ranks[hung], signal.SIGCONT)  # the launcher stops it and starts the group again
    stopped = f"rank {1 - hung} (pid {waiting.pid}) exited with code 0"  # a stop, not a crash
    assert eventually(lambda: stopped in dit.log.read_text(), 10), dit.log.read_text()[-2000:]


@pytest.mark.distributed
def test_the_store_listens_on_the_dits_host_only(dit):
    info = dit.serving()
    (((address, port), _),) = sockets(dit.process.pid, LISTEN)  # the store is the launcher's only server
    assert address == "127.0.0.1"
    for rank in info.ranks:
        env = environment(rank.pid)
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", str(port))


@pytest.mark.distributed
def test_the_ranks_share_cards_with_the_services_allocator_setting(dit):
    """`h3serve serve` sets the CUDA allocator's sharing setting (h3serve/cli/serve.py) before torch starts, where
    the user set none; the ranks inherit it through their launcher."""
    variable, setting = ALLOCATOR_SETTING
    assert variable not in os.environ  # the test's own environment sets none: what the ranks hold is serve's
    for rank in dit.serving().ranks:
        assert environment(rank.pid)[variable] == setting


@pytest.mark.distributed
def test_a_killed_rank_restarts_the_group(tmp_path):
    """On stand-in ranks: the real ranks' restart after a rank's death is test_dit_group.py's."""
    group = DiT(tmp_path, stand_in=True)
    try:
        before = group.ranks(restart=0)
        group.health_serving()
        os.kill(before[1], signal.SIGKILL)
        after = group.ranks(restart=1)
        group.health_serving()
        assert not set(after.values()) & set(before.values()), "every rank was replaced"
        assert f"rank 1 (pid {before[1]}) was killed by signal SIGKILL" in group.log.read_text()
    finally:
        group.close()


@pytest.mark.distributed
def test_sigterm_stops_the_launcher_with_exit_0_and_no_rank_left(dit):
    dit.ranks()
    logged = len(dit.log.read_text())
    dit.process.send_signal(signal.SIGTERM)
    assert dit.process.wait(60) == 0, dit.log.read_text()
    assert not living(dit.seen)
    stop = dit.log.read_text()[logged:]
    assert "signal SIGTERM: stopping the DiT group's 2 rank(s)" in stop
    assert "Traceback" not in stop and "ERROR" not in stop, stop


@pytest.mark.distributed
def test_sigkill_of_the_launcher_ends_every_rank_within_seconds(tmp_path):
    """On stand-in ranks: their parent-death signal is the launcher's to set (real ranks set it again themselves)."""
    group = DiT(tmp_path, stand_in=True)
    try:
        group.health_serving()
        ranks = group.ranks()
        group.process.kill()
        group.process.wait()
        assert eventually(lambda: not living(group.seen), 5), f"ranks outlived their launcher: {ranks}"
    finally:
        group.close()
