"""`h3serve up`'s watch over its services: a service that exits is started again, within the [supervisor] budget.

A service may restart `max_restarts` times within any `window_s` seconds, the k-th restart within the window after
`backoff_s * 2^(k-1)` seconds (at most `max_backoff_s`); one more exit ends the watch with the reason, and `up` then
stops everything and exits 1. What the dead service's process left (its process group: e.g. DiT ranks) is stopped
before the new one starts, so nothing of the old one holds its port or its GPU memory. A stop signal ends the watch
at once: nothing is restarted after it.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable

from h3serve.cli.launcher import Running, ServiceGroup
from h3serve.common.processes import RestartBudget, StopSignals, Tree, describe_exit, end_trees

POLL_S = 0.5


def _say(message: str) -> None:
    print(f"h3serve up: {message}", file=sys.stderr, flush=True)


class Watch:
    def __init__(self, group: ServiceGroup, stop: StopSignals) -> None:
        policy = group.config.supervisor
        self.group, self.stop, self.policy = group, stop, policy
        self.budgets = {name: RestartBudget(policy.max_restarts, policy.window_s, policy.backoff_s,
                                            policy.max_backoff_s) for name in group.names}
        self.due: dict[str, float] = {}  # service -> when it starts again

    def run(self, on_healthy: Callable[[], None]) -> str | None:
        """Until a stop signal (None) or a service past its budget (the reason)."""
        healthy = False
        while not self.stop:
            for item in list(self.group.running):
                reason = self._check(item)
                if reason:
                    return reason
            if not healthy and not self.due and self._all_ready():
                healthy = True
                on_healthy()
            self.stop.sleep(POLL_S)
        return None

    def _check(self, item: Running) -> str | None:
        if item.name in self.due:
            if time.monotonic() >= self.due[item.name] and not self.stop:
                del self.due[item.name]
                self.group.respawn(item.name)
            return None
        code = item.process.poll()
        if code is None:
            return None
        self._end_leftovers(item)
        ended = f"{item.name} {describe_exit(code)}"
        delay = self.budgets[item.name].take()
        if delay is None:
            return (f"{ended}, past its restart budget ({self.policy.max_restarts} restarts within "
                    f"{self.policy.window_s:.0f} s)")
        _say(f"{ended}; restarting it in {delay:.1f} s (restart {self.budgets[item.name].used()} of at most "
             f"{self.policy.max_restarts} within {self.policy.window_s:.0f} s)")
        self.due[item.name] = time.monotonic() + delay
        return None

    def _end_leftovers(self, item: Running) -> None:
        """SIGTERM what remains of the service's process group, the grace, then SIGKILL."""
        tree = Tree(item.process, leads_group=True)
        tree.signal(signal.SIGTERM)
        end_trees([tree], time.monotonic() + self.group.grace)

    def _all_ready(self) -> bool:
        return all(self.group.ready(item.address, root_pem=self.group.root_pem(item.name))
                   for item in self.group.running)
