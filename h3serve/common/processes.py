"""Child processes that never outlive their supervisor: parent-death signals, process-tree stops, restart budgets.

Shared by `h3serve up` (h3serve/cli/launcher.py) and the DiT's own launcher (h3serve/services/dit/supervisor.py).
Linux only where it matters (prctl, /proc); elsewhere a child simply gets no parent-death signal.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass

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


EXIT_REFUSED = 78  # sysexits' EX_CONFIG: a process refused its configuration; restarting it would only refuse again


def describe_exit(code: int) -> str:
    """How a Popen's returncode reads in a log: an exit code, or the signal that killed the process."""
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

    def __init__(self, process: subprocess.Popen, leads_group: bool) -> None:
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
        return min(self.max_backoff_s, self.backoff_s * 2 ** recent)

    def used(self) -> int:
        return self._recent()
