"""Two gateways on one PostgreSQL, each on a host of its own: four network namespaces (tests/namespaces.py), gateway
A, gateway B, PostgreSQL and the tiny model's encoder, DiT and VAE, with nginx in front on this machine's loopback.
The gateways share one blob directory (artifacts and uploads), as gateways on hosts of their own share a filesystem.

What a test does to one host (SIGKILL or SIGSTOP its gateway, cut its link) reaches only that host, as on separate
machines. Every process here is a fresh one (the tests' fork server lives in this machine's namespace: its forks
would not be on their host). nginx (from the OS packages: `make test` installs it where apt-get can) runs as a
non-daemon child with a generated configuration.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from deployments import QUICK_OUTAGE, STACK_MODEL, write_config
from namespaces import Hosts
from stores import PostgresServer, start_postgres

from h3serve.common import forkserver
from h3serve.common.config import SERVICES
from h3serve.common.free_ports import free_port
from h3serve.common.processes import Tree, end_trees
from h3serve.common.server import is_answering, is_serving
from h3serve.gateway.jobs.gateway_id import FILE_NAME

HOST_A, HOST_B, HOST_DB, HOST_STAGES = range(4)
START_S = 240.0  # fresh interpreters importing torch, three at once, on the loaded 2-core machine
STOP_GRACE_S = 20.0
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
NGINX_TEMP = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")  # its temporary directories, in its own root
# Buffering off: each SSE event goes out as the gateway sends it. HTTP/1.1 without `Connection: close` to the
# gateways; a connection a gateway refuses is tried on the next one.
NGINX_CONFIG = """worker_processes 1;
error_log {root}/error.log;
pid {root}/nginx.pid;
{user}
events {{ worker_connections 256; }}
http {{
  access_log off;
{temp}  upstream gateways {{
{servers}  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://gateways;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 3600s;
      proxy_next_upstream error timeout;
    }}
  }}
}}
"""


class NginxUnavailable(Exception):
    """nginx is not installed here, or did not start (the reason)."""


def _environment() -> dict[str, str]:
    """This process's environment less the fork server's address, whose forks would run on this machine's host (the
    DiT's launcher forks its ranks from the server its environment names)."""
    return {key: value for key, value in os.environ.items() if key != forkserver.ENV}


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as output:
        return subprocess.Popen(
            argv, stdout=output, stderr=subprocess.STDOUT, env=_environment(), start_new_session=True
        )


def _stop(processes: list[subprocess.Popen]) -> None:
    """SIGTERM to each (a stopped one is continued first), the grace, then SIGKILL of what is left of their trees."""
    trees = [Tree(process, leads_group=True) for process in processes if process.poll() is None]
    for tree in trees:
        with contextlib.suppress(ProcessLookupError):
            os.kill(tree.process.pid, signal.SIGCONT)
            os.kill(tree.process.pid, signal.SIGTERM)
    end_trees(trees, time.monotonic() + STOP_GRACE_S)
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(5)


def wait_until(ready, what: str, process: subprocess.Popen, log: Path, timeout_s: float = START_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited {process.returncode} during start-up:\n{tail(log)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout_s:.0f} s:\n{tail(log)}")
        time.sleep(0.2)


def tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


@dataclass
class Gateway:
    """One `h3serve serve gateway` on host `index`, on the shared store; `start` again after a kill resumes it."""

    name: str
    index: int
    hosts: Hosts
    config: Path
    port: int
    http_port: int
    log: Path
    data_dir: Path
    process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.hosts.address(self.index)}:{self.port}"

    @property
    def http_address(self) -> str:
        return f"{self.hosts.address(self.index)}:{self.http_port}"

    @property
    def gateway_id(self) -> str:
        """The id its leases carry (h3serve/gateway/jobs/gateway_id.py: kept in its data_dir)."""
        return (self.data_dir / FILE_NAME).read_text().strip()

    def start(self) -> None:
        argv = [sys.executable, "-m", "h3serve.cli", "serve", "gateway", "--config", str(self.config)]
        self.process = _start(self.hosts.run(self.index, argv), self.log)
        wait_until(lambda: is_answering(self.address), f"gateway {self.name}", self.process, self.log)

    def signal(self, signum: int) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signum)  # `ip netns exec` execs the gateway: its pid is the gateway's

    def kill(self) -> None:
        """SIGKILL, as a host that dies: no shutdown, its leases left to run out."""
        self.signal(signal.SIGKILL)
        assert self.process is not None
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None:
            _stop([self.process])

    @contextlib.contextmanager
    def cut_off(self) -> Iterator[None]:
        """Its host's link to the others down for the block (a network partition of the host)."""
        link = ["ip", "-n", self.hosts.name(self.index), "link", "set", "eth0"]
        subprocess.run([*link, "down"], check=True)
        try:
            yield
        finally:
            subprocess.run([*link, "up"], check=True)

    def until_logged(self, pattern: str, timeout_s: float) -> None:
        """Until its log has a line matching `pattern` (a regular expression)."""
        deadline = time.monotonic() + timeout_s
        while not re.search(pattern, self.log.read_text(errors="replace")):
            assert time.monotonic() < deadline, f"gateway {self.name} did not log {pattern!r}:\n{tail(self.log)}"
            time.sleep(0.5)


@dataclass
class Nginx:
    """nginx on 127.0.0.1:`port` in front of the gateways' HTTP doors (NGINX_CONFIG)."""

    root: Path
    upstreams: list[str]
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    def config(self) -> str:
        # Round-robin over the gateways: any of them streams any job live (LISTEN/NOTIFY), so a stream of a job
        # running on one may land on the other, and a reconnect after one dies goes to the next (proxy_next_upstream).
        servers = "".join(f"    server {address} max_fails=1 fail_timeout=2s;\n" for address in self.upstreams)
        temp = "".join(f"  {kind}_temp_path {self.root}/{kind};\n" for kind in NGINX_TEMP)
        return NGINX_CONFIG.format(
            root=self.root, user="user root;" if os.geteuid() == 0 else "", temp=temp, servers=servers, port=self.port
        )

    def start(self) -> None:
        if not os.access(NGINX, os.X_OK):
            raise NginxUnavailable("nginx is not installed (`make test` installs it where apt-get can)")
        (self.root / "nginx.conf").write_text(self.config())
        argv = [NGINX, "-p", str(self.root), "-c", str(self.root / "nginx.conf"), "-g", "daemon off;"]
        self.process = _start(argv, self.root / "nginx.log")
        try:
            wait_until(self._answers, "nginx", self.process, self.root / "nginx.log", timeout_s=30)
        except (RuntimeError, TimeoutError) as exc:
            raise NginxUnavailable(f"nginx did not start: {exc}\n{tail(self.root / 'error.log')}") from exc

    def _answers(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
            return True
        return False

    def stop(self) -> None:
        if self.process is not None:
            _stop([self.process])


@dataclass
class Topology:
    hosts: Hosts
    postgres: PostgresServer
    store_url: str  # the gateways' store: the database over TCP, on the database host's address
    gateways: dict[str, Gateway]
    nginx: Nginx

    @property
    def a(self) -> Gateway:
        return self.gateways["A"]

    @property
    def b(self) -> Gateway:
        return self.gateways["B"]

    @property
    def http(self) -> str:
        """nginx's address: the client's way in."""
        return f"127.0.0.1:{self.nginx.port}"

    def store_location(self) -> str:
        """The same database for this process's own reads (over the socket directory: no partition cuts it)."""
        return self.postgres.url(self.store_url.rsplit("/", 1)[1])


def _stage_services(hosts: Hosts, config: Path, root: Path) -> list[subprocess.Popen]:
    started = []
    for name in SERVICES:
        argv = [sys.executable, "-m", "h3serve.cli", "serve", name, "--config", str(config)]
        started.append(_start(hosts.run(HOST_STAGES, argv), root / f"{name}.log"))
    return started


@contextlib.contextmanager
def topology(root: Path, model_dir: Path) -> Iterator[Topology]:
    """The four hosts, PostgreSQL, the model services, gateways A and B, nginx; everything stopped and removed after.
    Raises namespaces.Unavailable, stores.PostgresUnavailable or NginxUnavailable where one cannot be had here."""
    with contextlib.ExitStack() as stack:
        hosts = stack.enter_context(Hosts(4))
        postgres = stack.enter_context(start_postgres(hosts.address(HOST_DB), hosts.run(HOST_DB, [])))
        store_url = postgres.tcp_url(postgres.create_database())
        stages = hosts.address(HOST_STAGES)
        ports = {name: free_port() for name in SERVICES}
        gateways = {}
        for name, index in (("A", HOST_A), ("B", HOST_B)):
            port, http_port, data_dir = free_port(), free_port(), root / f"gateway-{name}"
            config = write_config(
                root / f"deploy-{name}.toml",
                str(model_dir),
                data_dir,
                {**ports, "gateway": port},
                model=STACK_MODEL,
                service_keys={"host": stages},
                host=hosts.address(index),
                http_host=hosts.address(index),
                http_port=http_port,
                store_url=store_url,
                blob_dir=str(root / "blobs"),  # the shared filesystem both gateways' artifacts and uploads are on
                outage_s=QUICK_OUTAGE,
                retry_backoff_s=0.1,
            )
            gateways[name] = Gateway(
                name, index, hosts, config, port, http_port, root / f"gateway-{name}.log", data_dir
            )
        services = _stage_services(hosts, gateways["A"].config, root)
        stack.callback(_stop, services)
        for name, process in zip(SERVICES, services, strict=True):
            address = f"{stages}:{ports[name]}"
            wait_until(lambda address=address: is_serving(address), name, process, root / f"{name}.log")
        for gateway in gateways.values():
            stack.callback(gateway.stop)
            gateway.start()
        nginx = Nginx(root / "nginx", [g.http_address for g in gateways.values()])
        nginx.root.mkdir()
        stack.callback(nginx.stop)
        nginx.start()
        yield Topology(hosts, postgres, store_url, gateways, nginx)
