"""A hold point for tests: a served job waits at a chosen denoise step until the test lets it go.

A test that kills or cancels something mid-denoise needs a job that is provably still denoising when it acts; a long
CPU run only makes that likely, and costs minutes. With `H3SERVE_DIT_HOLD="<step>:<gate file>"` in the environment
rank 0 inherits, a served job (warm-ups are not served) that finishes step `<step>` while the gate file exists sends
that step's event, then waits until the gate is removed, its client cancels (a killed gateway cancels too) or
HOLD_LIMIT_S pass. So a test that has seen that event knows the job is at that step: whatever it kills or cancels
lands there. The step loop then goes on with its stop vote, which the other ranks wait in as behind a slow step.
Unset, the driver's `hold` is None: one `if` per step, nothing else. The tests' side: `tests/conftest.py::dit_hold`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ENV = "H3SERVE_DIT_HOLD"
# A test that never releases costs this, never a hang; well under the vote's collective_timeout_s (600 s by default).
HOLD_LIMIT_S = 120.0
POLL_S = 0.01  # a release or a cancel is seen within this
log = logging.getLogger("h3serve.dit.hold")


@dataclass(frozen=True)
class Hold:
    step: int
    gate: Path

    @property
    def setting(self) -> str:
        """The value of ENV that sets this hold."""
        return f"{self.step}:{self.gate}"

    def wait(self, step: int, cancelled: Callable[[], bool]) -> None:
        if step != self.step:
            return
        deadline = time.monotonic() + HOLD_LIMIT_S
        while self.gate.exists() and not cancelled():
            if time.monotonic() > deadline:
                log.warning("held at step %d for %g s, and %s is still there: going on", step, HOLD_LIMIT_S, self.gate)
                return
            time.sleep(POLL_S)


def from_environment() -> Hold | None:
    setting = os.environ.get(ENV)
    if not setting:
        return None
    step, gate = setting.split(":", 1)
    return Hold(int(step), Path(gate))
