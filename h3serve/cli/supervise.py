"""`h3serve up`'s watch over its services: a service that exits is started again, within the [supervisor] budget.

A service may restart `max_restarts` times within any `window_s` seconds, the k-th restart within the window after
`backoff_s * 2^(k-1)` seconds (at most `max_backoff_s`); one more exit ends the watch with the reason, and `up` then
stops everything and exits 1. Two exits end it at once: a refusal (EXIT_REFUSED: its configuration, or a port or data
directory another process holds), and the same start-up failure twice in a row (the same exit status or signal and
reason class, before the service ever reached SERVING), which a third start would only repeat. A SIGKILL with the host
near its memory limit at the last sample reads as the OOM killer's (common/processes.py, MemoryWatch). What the dead
service's process left (its process group: e.g. DiT ranks) is stopped before the new one starts, so nothing of the old
one holds its port or its GPU memory. A stop signal ends the watch at once: nothing is restarted after it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable

from h3serve.cli.launcher import Running, ServiceGroup
from h3serve.common.processes import (
    EXIT_REFUSED,
    MEMINFO,
    MemoryWatch,
    RepeatedFailure,
    RestartBudget,
    StopSignals,
    Tree,
    end_trees,
)

POLL_S = 0.5


def _say(message: str) -> None:
    print(f"h3serve up: {message}", file=sys.stderr, flush=True)


class Watch:
    def __init__(self, group: ServiceGroup, stop: StopSignals, meminfo: str = MEMINFO) -> None:
        policy = group.config.supervisor
        self.group, self.stop, self.policy = group, stop, policy
        self.budgets = {
            name: RestartBudget(policy.max_restarts, policy.window_s, policy.backoff_s, policy.max_backoff_s)
            for name in group.names
        }
        self.failures = {name: RepeatedFailure() for name in group.names}
        self.memory = MemoryWatch(meminfo)
        self.memory.sample_host()  # the services have just started
        self.due: dict[str, float] = {}  # service -> when it starts again
        self.ready: set[str] = set()  # services whose current process has reached SERVING
        self.last_exit: dict[str, str] = {}  # service -> how its last process ended (the reason `up` logged)

    def run(self, on_healthy: Callable[[], None]) -> str | None:
        """Until a stop signal (None) or a service that must not start again (the reason)."""
        healthy = False
        while not self.stop:
            for item in list(self.group.running):
                reason = self._check(item)
                if reason:
                    return reason
            self._sample()
            if not healthy and not self.due and len(self.ready) == len(self.group.running):
                healthy = True
                on_healthy()
            self.stop.sleep(POLL_S)
        return None

    def _sample(self) -> None:
        """Memory of every running service (figures from before a death), and which ones have reached SERVING."""
        alive = [item for item in self.group.running if item.name not in self.due and item.process.poll() is None]
        self.memory.sample(item.process.pid for item in alive)
        for item in alive:
            if item.name not in self.ready and self.group.ready(item.address, root_pem=self.group.root_pem(item.name)):
                self.ready.add(item.name)

    def _check(self, item: Running) -> str | None:
        if item.name in self.due:
            if time.monotonic() >= self.due[item.name] and not self.stop:
                del self.due[item.name]
                self.group.respawn(item.name)
                self.memory.sample_host()
            return None
        code = item.process.poll()
        if code is None:
            return None
        ending = self.memory.ending(item.process.pid, code, started=item.name in self.ready)
        self.ready.discard(item.name)
        self._end_leftovers(item)
        ended = self.last_exit[item.name] = f"{item.name} {ending.text}"
        if code == EXIT_REFUSED:
            return f"{ended}: not restarting it (the reason is {self._where_said(item.name)})"
        if self.failures[item.name].repeats(ending.kind, ending.start_up_failure):
            return f"stopped restarting: the same start-up failure twice: {ended}"
        delay = self.budgets[item.name].take()
        if delay is None:
            return (
                f"{ended}, past its restart budget ({self.policy.max_restarts} restarts within "
                f"{self.policy.window_s:.0f} s)"
            )
        _say(
            f"{ended}; restarting it in {delay:.1f} s (restart {self.budgets[item.name].used()} of at most "
            f"{self.policy.max_restarts} within {self.policy.window_s:.0f} s)"
        )
        self.due[item.name] = time.monotonic() + delay
        return None

    def _where_said(self, name: str) -> str:
        log_dir = self.group.log_dir
        return f"at the end of {os.path.join(log_dir, name + '.log')}" if log_dir else "in its output above"

    def _end_leftovers(self, item: Running) -> None:
        """SIGTERM what remains of the service's process group, the grace, then SIGKILL."""
        tree = Tree(item.process, leads_group=True)
        tree.signal(signal.SIGTERM)
        end_trees([tree], time.monotonic() + self.group.grace)
