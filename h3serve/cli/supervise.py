"""`h3serve up`'s watch over its services: a service that exits is started again, within the [supervisor] budget.

A service may restart `max_restarts` times within any `window_s` seconds, the k-th restart within the window after
`backoff_s * 2^(k-1)` seconds (at most `max_backoff_s`); one more exit ends the watch with the reason, and `up` then
stops everything and exits 1. Two exits end it at once: a refusal (EXIT_REFUSED: its configuration, or a port or data
directory another process holds), and the same start-up failure twice in a row (the same exit status or signal and
reason class, before the service ever reached SERVING), which a third start would only repeat. A SIGKILL with the host
near its memory limit at the last sample reads as the OOM killer's (common/processes.py, MemoryWatch). What the dead
service's process left (its process group: e.g. DiT ranks) is stopped before the new one starts, so nothing of the old
one holds its port or its GPU memory. Where the stages take turns on one card, a model service waiting for its turn
starts once every model service started before it serves (launcher.py). A start (the first or a restart) that has
not reached SERVING within `start_timeout_s` (a gateway: answered health, as its own SERVING waits for every stage's)
has its tree stopped and counts as such an exit. A stop signal ends the watch at once: nothing is restarted after it.

Each service's state (starting, serving, restart due, given up) goes to the state file the gateway reads
(common/supervision.py), rewritten at every change, so a job waits past its outage limit for a service being brought
back.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Hashable
from dataclasses import replace

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
from h3serve.common.server import is_answering
from h3serve.common.supervision import GIVEN_UP, RESTART_DUE, SERVING, STARTING, ServiceState, StateWriter

POLL_S = 0.5
START_TIMED_OUT = "start timed out"  # the kind of ending (RepeatedFailure) of a start stopped at start_timeout_s


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
        self.states = StateWriter(group.supervisor_state, policy.start_timeout_s)  # what the gateway reads of them
        for item in group.running:
            self._starting(item, restart=False)

    def run(self, on_healthy: Callable[[], None]) -> str | None:
        """Until a stop signal (None) or a service that must not start again (the reason)."""
        healthy = False
        while not self.stop:
            for item in list(self.group.running):
                reason = self._check(item)
                if reason:
                    return reason
            self._sample()
            if not healthy and not self.due and not self.group.waiting and len(self.ready) == len(self.group.running):
                healthy = True
                on_healthy()
            self.stop.sleep(POLL_S)
        return None

    def _sample(self) -> None:
        """Memory of every running service (figures from before a death), and which ones have reached SERVING."""
        alive = [item for item in self.group.running if item.name not in self.due and item.process.poll() is None]
        self.memory.sample(item.process.pid for item in alive)
        for item in alive:
            if item.name not in self.ready and self._serving(item):
                self.ready.add(item.name)
                self.states.set(item.name, replace(self.states.services[item.name], state=SERVING, since=time.time()))
        if self.group.turn_due(self.ready):
            self._starting(self.group.start_next(), restart=False)  # its turn on the card (launcher.py)

    def _serving(self, item: Running) -> bool:
        """A model service once it says SERVING; the gateway once it answers: its SERVING also waits for every stage's,
        which is no part of its own start (a gateway restarted while a stage restarts would otherwise time out)."""
        probe = is_answering if item.name == "gateway" else self.group.ready
        return probe(item.address, root_pem=self.group.root_pem(item.name))

    def _starting(self, item: Running, restart: bool) -> None:
        self.states.set(item.name, ServiceState(STARTING, item.started_at, item.process.pid, restart))

    def _check(self, item: Running) -> str | None:
        if item.name in self.due:
            if time.monotonic() >= self.due[item.name] and not self.stop:
                del self.due[item.name]
                self._starting(self.group.respawn(item.name), restart=True)
                self.memory.sample_host()
            return None
        code = item.process.poll()
        if code is None:
            return self._time_out(item) if self._start_overdue(item) else None
        ending = self.memory.ending(item.process.pid, code, started=item.name in self.ready)
        self._end_leftovers(item)
        ended = f"{item.name} {ending.text}"
        if code == EXIT_REFUSED:
            return self._give_up(item.name, f"{ended}: not restarting it (the reason is {self._where_said(item.name)})")
        return self._restart(item.name, ended, ending.kind, ending.start_up_failure)

    def _start_overdue(self, item: Running) -> bool:
        return item.name not in self.ready and time.monotonic() - item.started > self.policy.start_timeout_s

    def _time_out(self, item: Running) -> str | None:
        """A start that has not reached SERVING within start_timeout_s: its tree is stopped, and it counts as an exit
        that never served."""
        self._end_leftovers(item)
        ended = (
            f"{item.name} did not serve within {self.policy.start_timeout_s:g} s of its start "
            "([supervisor] start_timeout_s) and was stopped"
        )
        return self._restart(item.name, ended, START_TIMED_OUT, start_up_failure=True)

    def _restart(self, name: str, ended: str, kind: Hashable, start_up_failure: bool) -> str | None:
        """Service `name`'s process has ended (`ended` says how): its restart is due after its back-off, or, past a
        rule of the budget, the reason the watch ends."""
        self.ready.discard(name)
        if self.failures[name].repeats(kind, start_up_failure):
            return self._give_up(name, f"stopped restarting: the same start-up failure twice: {ended}")
        delay = self.budgets[name].take()
        if delay is None:
            return self._give_up(
                name,
                f"{ended}, past its restart budget ({self.policy.max_restarts} restarts within "
                f"{self.policy.window_s:.0f} s)",
            )
        _say(
            f"{ended}; restarting it in {delay:.1f} s (restart {self.budgets[name].used()} of at most "
            f"{self.policy.max_restarts} within {self.policy.window_s:.0f} s)"
        )
        self.due[name] = time.monotonic() + delay
        self.states.set(name, ServiceState(RESTART_DUE, time.time(), due=time.time() + delay, reason=ended))
        return None

    def _give_up(self, name: str, reason: str) -> str:
        self.states.set(name, ServiceState(GIVEN_UP, time.time(), reason=reason))
        return reason

    def _where_said(self, name: str) -> str:
        log_dir = self.group.log_dir
        return f"at the end of {os.path.join(log_dir, name + '.log')}" if log_dir else "in its output above"

    def _end_leftovers(self, item: Running) -> None:
        """SIGTERM what remains of the service's process group, the grace, then SIGKILL."""
        tree = Tree(item.process, leads_group=True)
        tree.signal(signal.SIGTERM)
        end_trees([tree], time.monotonic() + self.group.grace)
