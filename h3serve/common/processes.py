"""Child processes that never outlive their supervisor: parent-death signals, process-tree stops, restart budgets,
why a child died (the OOM killer, judged from memory sampled while it ran), and one owner per port and directory.

Shared by `h3serve up` (h3serve/cli/launcher.py) and the DiT's own launcher (h3serve/services/dit/supervisor.py).
Linux only where it matters (prctl, /proc, flock); elsewhere a child simply gets no parent-death signal.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import re
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import IO, NoReturn, Protocol

PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
POLL_S = 0.1


def set_parent_death_signal(signum: int) -> None:
    """The kernel sends `signum` to this process when the thread that started it exits."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum)


def _dies_with(parent: int, signum: int):
    """A preexec_fn: prctl is resolved here, before the fork, so the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signum)
        if os.getppid() != parent:  # the parent died before prctl: the signal will never come
            os._exit(1)

    return preexec


def spawn(argv: list[str], death_signal: int = signal.SIGTERM, **popen) -> subprocess.Popen:
    """Popen with a parent-death signal. Call it from a thread that lives as long as the process (the main thread):
    the kernel signals the child when the thread that forked it exits."""
    return subprocess.Popen(argv, preexec_fn=_dies_with(os.getpid(), death_signal), **popen)


class Child(Protocol):
    """A started process as its starter sees it: a `subprocess.Popen`, or a fork server's `Forked`."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, signum: int) -> None: ...

    def kill(self) -> None: ...


EXIT_REFUSED = 78  # sysexits' EX_CONFIG: a process refused its configuration; restarting it would only refuse again


class Refused(Exception):
    """What no restart can fix (a port or a directory another process holds): the process exits EXIT_REFUSED."""


def refuse(reason: str) -> NoReturn:
    """Exit EXIT_REFUSED with the reason on stderr; a supervisor stops instead of restarting it."""
    print(f"refused: {reason}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_REFUSED)


def describe_exit(code: int) -> str:
    """How a Popen's returncode reads in a log: an exit code, or the signal that killed the process."""
    if code == EXIT_REFUSED:
        return f"refused to start (exit code {code})"
    if code >= 0:
        return f"exited with code {code}"
    with contextlib.suppress(ValueError):
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"was killed by signal {-code}"


@dataclass(frozen=True)
class Proc:
    """A process by pid and start time, so a pid the kernel reused later is not mistaken for it."""

    pid: int
    start: str

    @classmethod
    def of(cls, pid: int) -> Proc | None:
        fields = _stat(pid)
        return cls(pid, fields[19]) if fields else None

    def alive(self) -> bool:
        fields = _stat(self.pid)
        return bool(fields) and fields[19] == self.start and fields[0] != "Z"


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat from the state field on (the command name may hold spaces); [] when gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def children(pid: int) -> list[int]:
    """The direct child processes of `pid` (Linux /proc; empty where unknown)."""
    found = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as file:
                found += [int(child) for child in file.read().split()]
    return found


def descendants(pid: int) -> list[int]:
    return [p for child in children(pid) for p in (child, *descendants(child))]


def service_pid(root: int, name: str) -> int | None:
    """The pid of `h3serve up`'s service `name` among `root`'s descendants, by its command line (`h3serve serve NAME`,
    a fork of the fork server's too; the DiT's launcher execs itself as its supervisor module); None while it has
    none."""
    marks = [f" serve {name} ", *([" -m h3serve.services.dit.supervisor "] if name == "dit" else [])]
    found = [pid for pid in descendants(root) if any(mark in command_line(pid, 1 << 20) + " " for mark in marks)]
    return found[0] if found else None


def process_groups() -> dict[int, set[Proc]]:
    """Every live process by process group, wherever it was reparented (one pass over /proc)."""
    groups: dict[int, set[Proc]] = {}
    for name in os.listdir("/proc"):
        fields = _stat(int(name)) if name.isdigit() else []
        if fields and fields[0] != "Z":
            groups.setdefault(int(fields[2]), set()).add(Proc(int(name), fields[19]))
    return groups


class Tree:
    """A child process and what it started: its descendants and, for one spawned as a process group leader (a session
    of its own), every member of that group, including those orphaned by a parent that died."""

    def __init__(self, process: Child, leads_group: bool) -> None:
        self.process, self.leads_group = process, leads_group
        self.procs = {proc for proc in map(Proc.of, (process.pid, *descendants(process.pid))) if proc}
        self.refresh(process_groups() if leads_group else {})

    def refresh(self, groups: dict[int, set[Proc]]) -> None:
        """Add what is in the group now (what the tree started meanwhile ends with it)."""
        if self.leads_group:
            self.procs |= groups.get(self.process.pid, set())

    def alive(self) -> bool:
        self.process.poll()  # reap the child, else it stays a zombie
        return any(proc.alive() for proc in self.procs)

    def signal(self, signum: int) -> None:
        for proc in self.procs:
            if proc.alive():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(proc.pid, signum)


def end_trees(trees: list[Tree], deadline: float) -> None:
    """Wait until every tree has ended, until `deadline`; then SIGKILL what remains of them."""
    while True:
        groups = process_groups()
        for each in trees:
            each.refresh(groups)
        if time.monotonic() >= deadline or not any(each.alive() for each in trees):
            break
        time.sleep(POLL_S)
    for each in trees:
        each.signal(signal.SIGKILL)
        each.process.wait()


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP ask for a stop. The handler only records it (the first signal's number); the
    supervising loop acts on it, so a signal never interrupts a spawn or a stop half-way."""

    def __init__(self, signals=STOP_SIGNALS) -> None:
        self.signum: int | None = None
        for signum in signals:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.signum = self.signum or signum

    def __bool__(self) -> bool:
        return self.signum is not None

    def sleep(self, seconds: float) -> None:
        """Sleep, returning early once a stop was asked for."""
        deadline = time.monotonic() + seconds
        while not self and time.monotonic() < deadline:
            time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))


class RestartBudget:
    """At most `max_restarts` restarts within any `window_s` seconds; the k-th restart in the window waits
    `backoff_s * 2^(k-1)`, at most `max_backoff_s`."""

    def __init__(self, max_restarts: int, window_s: float, backoff_s: float, max_backoff_s: float) -> None:
        self.max_restarts, self.window_s = max_restarts, window_s
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.restarts: deque[float] = deque()

    def _recent(self) -> int:
        while self.restarts and time.monotonic() - self.restarts[0] > self.window_s:
            self.restarts.popleft()
        return len(self.restarts)

    def take(self) -> float | None:
        """Count a restart now; returns its back-off in seconds, or None when the budget is spent."""
        recent = self._recent()
        if recent >= self.max_restarts:
            return None
        self.restarts.append(time.monotonic())
        return min(self.max_backoff_s, self.backoff_s * 2**recent)

    def used(self) -> int:
        return self._recent()


class RepeatedFailure:
    """The same start-up failure twice in a row (the same exit status or signal and reason class, neither start having
    reached ready) would only repeat: the supervisor stops restarting instead of spending its budget on it. An exit 0
    is no failure (a stop: SIGTERM ends a service or a rank with 0), and an ending after ready resets the count."""

    def __init__(self) -> None:
        self.last: Hashable | None = None  # the previous ending's kind, when it was a start-up failure

    def repeats(self, kind: Hashable, start_up_failure: bool) -> bool:
        """Record an ending of `kind`; True when it and the previous one are the same start-up failure."""
        repeat = start_up_failure and kind == self.last
        self.last = kind if start_up_failure else None
        return repeat


# Why a process died. SIGKILL says nothing by itself, and the kernel log is not readable here: the kernel frees a
# killed process's memory at once, so only figures sampled while it ran can say whether the OOM killer took it.

MEMINFO = "/proc/meminfo"
GIB = 1 << 30
LOW_AVAILABLE_SHARE = 0.05  # near the host's limit: MemAvailable under this share of MemTotal at the last sample,
LARGE_ANON_SHARE = 0.5  # or the process alone holding this share of MemTotal (the OOM killer picks the largest)


@dataclass(frozen=True)
class HostMemory:
    total: int  # bytes: MemTotal
    available: int  # bytes: MemAvailable


def read_meminfo(path: str = MEMINFO) -> HostMemory | None:
    """The host's MemTotal and MemAvailable from `path` (a meminfo file); None where unreadable."""
    try:
        with open(path) as file:
            found = dict(re.findall(r"^(MemTotal|MemAvailable):\s+(\d+) kB", file.read(), re.M))
        return HostMemory(int(found["MemTotal"]) << 10, int(found["MemAvailable"]) << 10)
    except (OSError, KeyError):
        return None


def process_anon(pid: int) -> int | None:
    """Process `pid`'s anonymous resident memory in bytes (RssAnon; VmRSS where the kernel has no RssAnon); None once
    it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/status") as file:
            found = dict(re.findall(r"^(RssAnon|VmRSS):\s+(\d+) kB", file.read(), re.M))
    except OSError:
        return None
    value = found.get("RssAnon", found.get("VmRSS"))
    return int(value) << 10 if value else None


def near_memory_limit(host: HostMemory, anon: int | None) -> bool:
    """Whether the figures sampled last before a SIGKILL make the OOM killer its most likely sender."""
    return host.available < LOW_AVAILABLE_SHARE * host.total or (anon or 0) >= LARGE_ANON_SHARE * host.total


def describe_memory(host: HostMemory, anon: int | None) -> str:
    held = (
        f"the process held {anon / GIB:.2f} GiB (anon) at its last sample"
        if anon is not None
        else "the process itself was not sampled"
    )
    return f"host had {host.available / GIB:.2f} GiB available of {host.total / GIB:.2f} GiB, {held}"


@dataclass(frozen=True)
class Ending:
    """How a supervised process ended."""

    code: int  # Popen's returncode
    oom: bool  # a SIGKILL with the host near its memory limit at the last sample
    started: bool  # it had reached ready (SERVING) before it ended
    text: str  # how it reads in a log, after the process's name

    @property
    def kind(self) -> tuple[int, bool]:
        """What two endings share when they are the same failure: the exit status or signal, and its reason class."""
        return self.code, self.oom

    @property
    def start_up_failure(self) -> bool:
        return self.code != 0 and not self.started


class MemoryWatch:
    """The host's memory and each watched process's, sampled while they run, to tell why one was SIGKILLed."""

    def __init__(self, meminfo: str = MEMINFO) -> None:
        self.meminfo = meminfo  # a meminfo file: /proc/meminfo, or a test's stand-in
        self.host: HostMemory | None = None
        self.anon: dict[int, int] = {}  # pid -> bytes at its last sample

    def sample_host(self) -> None:
        """The host alone: when a process starts, so a death before the next sample still has the host's figures
        (the new process's own are not its yet: it is still the forked copy of its parent)."""
        self.host = read_meminfo(self.meminfo) or self.host

    def sample(self, pids: Iterable[int]) -> None:
        """Sample the host and `pids`; a process that cannot be read now (a zombie) keeps its last figure."""
        self.sample_host()
        self.anon = {pid: anon for pid in pids if (anon := process_anon(pid) or self.anon.get(pid)) is not None}

    def ending(self, pid: int, code: int, started: bool) -> Ending:
        """How process `pid` ended with returncode `code`, judged from the figures sampled before."""
        anon = self.anon.pop(pid, None)
        if code != -signal.SIGKILL or self.host is None or not near_memory_limit(self.host, anon):
            return Ending(code, False, started, describe_exit(code))
        return Ending(
            code,
            True,
            started,
            "was most likely killed by the kernel's OOM killer: " + describe_memory(self.host, anon),
        )


# One owner per port and per directory: a second `h3serve up` on the same configuration is refused at start.

TCP_LISTEN = "0A"


def listening_sockets(port: int) -> set[str]:
    """The inodes of the sockets listening on TCP `port`, on any address (/proc/net/tcp and tcp6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as file:
            rows = [line.split() for line in file.readlines()[1:]]
        inodes |= {row[9] for row in rows if row[3] == TCP_LISTEN and int(row[1].rsplit(":", 1)[1], 16) == port}
    return inodes


def port_holders(port: int) -> list[str] | None:
    """Who listens on TCP `port`, on any address: "pid N (command)" each, best effort (then /proc/*/fd; another
    user's processes stay unnamed); None when nothing listens on it."""
    inodes = listening_sockets(port)
    if not inodes:
        return None
    sockets = {f"socket:[{inode}]" for inode in inodes}
    return [f"pid {pid} ({command_line(pid)})" for pid in sorted(holders_of(sockets))]


def wait_port_released(port: int, deadline: float) -> bool:
    """Until nothing listens on TCP `port`, or `deadline`: whether it was released. What listened for a process may
    end a moment after it: the DiT's ranks are the fork server's children, which their death signal ends once
    the server has seen their launcher's connection close."""
    while listening_sockets(port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S / 4)
    return True


def holders_of(targets: set[str]) -> set[int]:
    """Processes with any of `targets` open (what /proc/PID/fd links read: a path, "socket:[inode]"): best effort,
    this user's processes."""
    owners = set()
    with contextlib.suppress(OSError):
        for name in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{name}/fd"):
                    with contextlib.suppress(OSError):
                        if os.readlink(f"/proc/{name}/fd/{fd}") in targets:
                            owners.add(int(name))
                            break
    return owners


def command_line(pid: int, limit: int = 160) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            command = file.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"
    return command if len(command) <= limit else command[: limit - 3] + "..."


LOCK_FILE = ".h3serve.lock"


def lock_directory(directory: str) -> IO[str]:
    """Hold `directory` exclusively while the returned file stays open (keep it for the process's lifetime; the
    kernel drops the lock when the process ends, however it ends): flock on LOCK_FILE inside it, which records the
    holder's pid. Raises Refused naming the directory and the holder."""
    os.makedirs(directory, exist_ok=True)
    file = open(os.path.join(directory, LOCK_FILE), "a+")  # opened close-on-exec: no child inherits the lock
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = file.read().strip() or "?"
        file.close()
        command = command_line(int(holder)) if holder.isdigit() else "?"
        raise Refused(f"{directory} is in use by pid {holder} ({command}), which holds its lock {LOCK_FILE}") from None
    file.truncate(0)
    file.write(f"{os.getpid()}\n")
    file.flush()
    return file
