"""Per-phase stall detection for stage calls.

Each phase (encode, denoise, decode, mux) has its own limit, measured from its last progress event,
not from the start of the job: decode and mux report progress too, so a long but healthy decode is
never mistaken for a stall (the field notes' watchdog killed healthy jobs after the last denoise step).
A stalled call is cancelled and `Stuck` is raised with the phase and the limit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

from h3serve.common.config import STALL_DEFAULTS

CHECK_PERIOD_S = 1.0


class Stuck(Exception):
    def __init__(self, phase: str, limit_s: float):
        self.phase, self.limit_s = phase, limit_s
        super().__init__(f"stuck in {phase} for {limit_s:g} s")


class Watchdog:
    def __init__(self, limits: dict[str, float]):
        self.limits = {**STALL_DEFAULTS, **limits}
        unknown = set(self.limits) - set(STALL_DEFAULTS)
        if unknown:
            raise ValueError(
                f"stall_s: unknown phase(s) {', '.join(sorted(unknown))}; known: {', '.join(STALL_DEFAULTS)}"
            )
        self.phase = ""
        self.events = 0  # progress events seen: a try that made some, made progress
        self._last = time.monotonic()

    def progress(self, phase: str) -> None:
        """A progress event of `phase` (which also becomes the current phase): its clock starts again."""
        self._enter(phase)
        self.events += 1

    def _enter(self, phase: str) -> None:
        self.phase, self._last = phase, time.monotonic()

    async def run(self, phase: str, call: Awaitable):
        """Await `call` in `phase`; cancel it and raise Stuck when the current phase goes quiet too long.

        The limit is looked at again at least every CHECK_PERIOD_S, so a phase change to a shorter limit takes
        effect within that; the only task besides the caller's is the call itself, cancelled on every way out."""
        self._enter(phase)
        task = asyncio.ensure_future(call)
        try:
            while True:
                remaining = self.limits[self.phase] - (time.monotonic() - self._last)
                if remaining <= 0:
                    raise Stuck(self.phase, self.limits[self.phase])
                done, _ = await asyncio.wait({task}, timeout=min(remaining, CHECK_PERIOD_S))
                if done:
                    return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
