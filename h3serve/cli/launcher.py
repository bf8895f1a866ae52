"""`h3serve up`, `demo` and the tests' stacks: start encoder, DiT, VAE and gateway as processes, wait until
healthy, stop cleanly (`up` also restarts them: h3serve/cli/supervise.py).

Each model service sees only its own GPUs (CUDA_VISIBLE_DEVICES from its `gpus` setting). Each runs in a
session of its own, so a Ctrl-C at the terminal reaches the launcher only, which stops them in order, and
each gets SIGTERM when the launcher dies (parent-death signal), so even `kill -9` of it leaves none behind.
A stop ends each service's whole tree: SIGTERM, the grace, then SIGKILL of what remains of it, anything
left in its process group included.

With `[gateway] stages_take_turns` (one card for every stage) the model services start one at a time as well, each
once the one before it serves: started together, their loads and warm-ups overlapped on the card, which the plan's
busiest turn does not count (the 24 GB profile's start held 22.6 GiB of the card at once against 15.8 planned,
docs/memory-plan.md). The gateway starts with the first.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from h3serve.cli import box as boxes
from h3serve.common import forkserver, processes
from h3serve.common.config import SERVICES, WILDCARD_HOSTS, ConfigError, DeployConfig
from h3serve.common.processes import Tree, children, describe_exit, end_trees
from h3serve.common.server import is_answering, is_serving
from h3serve.common.supervision import STATE_ENV
from h3serve.services import preload

__all__ = ["START_ORDER", "Running", "ServiceGroup", "children", "is_answering", "is_serving"]

START_ORDER = (*SERVICES, "gateway")
# How long a restart waits for its old instance's port to be released before it starts anyway (and is refused):
# ranks forked for a killed DiT launcher end on their death signal, a moment after it.
PORT_RELEASE_S = 10.0
START_ERROR_LINES = 20  # of a service's log, in the error when it ends during start-up


@dataclass
class Running:
    name: str
    address: str
    process: processes.Child
    started: float = field(default_factory=time.monotonic)  # [supervisor] start_timeout_s runs from here
    started_at: float = field(default_factory=time.time)  # the same moment in unix seconds, for the state file


class ServiceGroup:
    def __init__(
        self,
        config: DeployConfig,
        config_path: str | None,
        log_dir: str | None = None,
        names: tuple[str, ...] = START_ORDER,
        ready=is_serving,
        flags: dict[str, list[str]] | None = None,
        supervisor_state: str | None = None,
    ) -> None:
        self.ready = ready  # is_serving, or is_answering to start a gateway whose stages are down
        self.config = config
        self.names = names
        self.config_path = config_path
        self.log_dir = log_dir
        self.flags = flags or {}  # per service: `h3serve serve` flags that override the config file
        self.grace = config.supervisor.stop_grace_s
        self.supervisor_state = supervisor_state  # `up`'s state file, which the gateway reads (common/supervision.py)
        self.running: list[Running] = []
        self.waiting: list[str] = []  # model services not started yet: they wait for their turn on the card
        self.fork_server: forkserver.ForkServer | None = None
        self.owns_fork_server = False

    def _later_turns(self) -> list[str]:
        """The model services that start only once the one before them serves: every one after the first where the
        stages take turns on one card, none otherwise."""
        if not self.config.gateway.stages_take_turns:
            return []
        return [name for name in self.names if name in SERVICES][1:]

    def turn_due(self, serving: set[str]) -> bool:
        """Whether a model service waits for its turn and every model service started so far is in `serving`."""
        return bool(self.waiting) and all(item.name in serving for item in self.running if item.name in SERVICES)

    def start_next(self) -> Running:
        """Start the next model service waiting for its turn, in its place in the start order (a stop goes in reverse
        of it)."""
        name = self.waiting.pop(0)
        item = self._spawn(name)
        later = [i for i, other in enumerate(self.running) if self.names.index(other.name) > self.names.index(name)]
        self.running.insert(later[0] if later else len(self.running), item)
        return item

    def _command(self, name: str) -> list[str]:
        command = [sys.executable, "-m", "h3serve.cli", "serve", name]
        return command + (["--config", self.config_path] if self.config_path else []) + self.flags.get(name, [])

    def _env(self, name: str) -> dict[str, str]:
        env = dict(os.environ)
        if name != "gateway" and self.config.service(name).gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.config.service(name).gpus
        if name != "gateway" and self.fork_server:
            env[forkserver.ENV] = self.fork_server.path  # the DiT's launcher forks its ranks from it too
        if name == "gateway" and self.supervisor_state:
            env[STATE_ENV] = self.supervisor_state
        return env

    def root_pem(self, name: str) -> bytes | None:
        """How to probe a TLS service: the gateway's stage_tls_ca if set, else its own (self-signed) certificate."""
        section = self.config.service(name) if name != "gateway" else self.config.gateway
        if not section.tls_cert:
            return None
        with open(self.config.gateway.stage_tls_ca or section.tls_cert, "rb") as file:
            return file.read()

    def _spawn(self, name: str) -> Running:
        section = self.config.service(name) if name != "gateway" else self.config.gateway
        log = open(os.path.join(self.log_dir, f"{name}.log"), "ab") if self.log_dir else contextlib.nullcontext()
        with log as output:  # the child has its own copy
            process = forkserver.start(
                self._command(name),
                self.fork_server if name != "gateway" else None,  # the gateway imports no torch
                env=self._env(name),
                stdout=output,
                stderr=subprocess.STDOUT if output else None,
                start_new_session=True,
            )
        return Running(name, f"{section.host}:{section.port}", process)

    def process_roots(self) -> list[int]:
        """Every process this group started is in the tree of one of these: the services and, with a fork server of
        its own, the server (the model services and the DiT's ranks are its children)."""
        owned = [self.fork_server.process.pid] if self.fork_server and self.fork_server.process else []
        return [item.process.pid for item in self.running] + owned

    def respawn(self, name: str) -> Running:
        """Start service `name` again in its place (its old process has ended), once its port is free or after
        PORT_RELEASE_S: a start that found it held would refuse to start, and `up` takes a refusal as final."""
        index = next(i for i, item in enumerate(self.running) if item.name == name)
        port = self.running[index].address.rsplit(":", 1)[1]
        processes.wait_port_released(int(port), time.monotonic() + PORT_RELEASE_S)
        self.running[index] = self._spawn(name)
        return self.running[index]

    def _start_fork_server(self) -> None:
        """The one above this launcher (its environment names it), else one of its own where it starts a model
        service on a host with the model's packages and `[supervisor] fork_server` is on."""
        self.fork_server = forkserver.ForkServer.from_env()
        wanted = self.config.supervisor.fork_server and set(self.names) & set(SERVICES)
        if not self.fork_server and wanted and importlib.util.find_spec("torch"):
            self.fork_server, self.owns_fork_server = forkserver.ForkServer.launch(preload.__name__), True

    def listeners(self) -> list[tuple[str, str, int]]:
        """(config key, host, port) of every port the services of this group listen on."""
        gateway = self.config.gateway
        every = {name: [("port", self.config.service(name).host, self.config.service(name).port)] for name in SERVICES}
        every["gateway"] = [
            ("port", gateway.host, gateway.port),
            ("metrics_port", gateway.metrics_host, gateway.metrics_port),
            ("http_port", gateway.http_host, gateway.http_port),
        ]
        return [(f"[{name}] {key}", host, port) for name in self.names for key, host, port in every[name] if port]

    def check_ports(self) -> None:
        """Refuse two listeners on one port of this host before anything starts: the later one would fail its bind,
        a failure that reads as a crash."""
        listeners = self.listeners()
        shared = [
            f"{key} = {port} is also {other_key}: give each listener a port of its own"
            for i, (key, host, port) in enumerate(listeners)
            for other_key, other_host, other_port in listeners[:i]
            if port == other_port and (host == other_host or host in WILDCARD_HOSTS or other_host in WILDCARD_HOSTS)
        ]
        if shared:
            raise ConfigError("\n".join(f"{self.config_path or 'the deployment'} {line}" for line in shared))

    def check_cards(self) -> None:
        """Refuse a deployment planned for a larger card than this machine has, before anything starts: its
        services would load into memory the card does not have, and its plan admit what cannot run. Only where
        this group starts a model service on a GPU (a gateway host's own GPU, if any, is not the deployment's)."""
        on_gpu = any(self.config.service(name).device != "cpu" for name in set(self.names) & set(SERVICES))
        boxes.require_the_card(self.config, self.config_path, on_gpu)

    def claim(self) -> None:
        """Refused (naming each port or directory and its holder) when another process holds one of this group's
        ports or its gateway's data directory: another `h3serve up` on this configuration, or on this data_dir with
        other ports. Checked before anything starts, so nothing of a refused group ever serves (its services would
        otherwise each load, serve, and be refused one by one)."""
        taken = [
            f"{key} = {port}: the port is in use by {', '.join(holders) or 'a process of another user'}"
            for key, _, port in self.listeners()
            if (holders := processes.port_holders(port)) is not None
        ]
        data_dir = self._gateway_data_dir()
        if "gateway" in self.names and os.path.isdir(data_dir):  # a directory not made yet is nobody's
            try:
                processes.lock_directory(data_dir).close()  # taken and let go: free now
            except processes.Refused as exc:
                taken.append(f"[gateway] data_dir: {exc}")
        if taken:
            raise processes.Refused(
                f"{self.config_path or 'the deployment'}: {'; '.join(taken)}. Stop what holds them (another "
                "`h3serve up`?) or give this deployment ports and a data_dir of its own"
            )

    def _gateway_data_dir(self) -> str:
        """The data directory the gateway will lock: its --data-dir flag (the demo's fresh one), else the file's."""
        flags = self.flags.get("gateway", [])
        given = flags.index("--data-dir") + 1 if "--data-dir" in flags else 0
        return flags[given] if given else self.config.gateway.data_dir

    def start(self) -> None:
        """Start every service, once the group owns its ports and data directory (else exit EXIT_REFUSED, having
        started nothing)."""
        self.check_ports()
        self.check_cards()
        try:
            self.claim()
        except processes.Refused as exc:
            processes.refuse(f"h3serve up: {exc}")
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
        self._start_fork_server()
        self.waiting = self._later_turns()
        self.running.extend(self._spawn(name) for name in self.names if name not in self.waiting)

    def restart(self, name: str, signum: int = signal.SIGTERM) -> None:
        """Stop one service with `signum` (SIGKILL simulates a crash), start it again, wait until healthy."""
        old = next(item.process for item in self.running if item.name == name)
        tree = Tree(old, leads_group=True)
        old.send_signal(signum)
        end_trees([tree], time.monotonic() + self.grace)
        self.respawn(name)
        self.wait_healthy()

    def wait_healthy(self) -> None:
        """Until every service is healthy, starting each one waiting for its turn once no model service is starting;
        each has `start_timeout_s` from its own start."""
        timeout = self.config.supervisor.start_timeout_s
        pending = [item for item in self.running if not self.ready(item.address, root_pem=self.root_pem(item.name))]
        while pending or self.waiting:
            for item in list(pending):
                if (code := item.process.poll()) is not None:
                    raise RuntimeError(f"{item.name} {describe_exit(code)} during start-up{self.log_tail(item.name)}")
                if self.ready(item.address, root_pem=self.root_pem(item.name)):
                    pending.remove(item)
            if self.turn_due({item.name for item in self.running if item not in pending}):
                pending.append(self.start_next())
            if overdue := [item.name for item in pending if time.monotonic() - item.started > timeout]:
                raise TimeoutError(
                    f"not healthy after {timeout:.0f} s ([supervisor] start_timeout_s): {', '.join(overdue)}"
                )
            time.sleep(0.2)

    def log_tail(self, name: str) -> str:
        """The end of service `name`'s log, for an error that would otherwise not say why it ended ("" without a
        log directory: its output went to the launcher's terminal)."""
        if not self.log_dir:
            return ""
        path = os.path.join(self.log_dir, f"{name}.log")
        with contextlib.suppress(OSError), open(path, errors="replace") as log:
            lines = log.read().splitlines()[-START_ERROR_LINES:]
            return f"; the end of {path}:\n" + "\n".join(lines)
        return ""

    def _stop_targets(self, item: Running) -> list[int]:
        """Who gets the stop signal: the service's process, except for a DiT over several nodes, whose process is
        torchrun, which turns any signal into a SignalException (a traceback) and a failed group; its ranks exit 0
        on SIGTERM, and torchrun then ends, exit 0, as a finished group."""
        ranks = children(item.process.pid) if item.name == "dit" and self.config.dit.nnodes > 1 else []
        return ranks or [item.process.pid]

    def stop(self) -> None:
        """SIGTERM in reverse start order (gateway first), then the grace for every tree to end, then SIGKILL."""
        trees = [Tree(item.process, leads_group=True) for item in reversed(self.running)]
        for item in reversed(self.running):
            if item.process.poll() is None:
                for pid in self._stop_targets(item):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
        end_trees(trees, time.monotonic() + self.grace)
        self.running.clear()
        if self.fork_server and self.owns_fork_server:
            self.fork_server.stop()
        self.fork_server = None

    def __enter__(self) -> ServiceGroup:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
