"""Holding a job mid-denoise on purpose, so a kill or a cancel provably lands there (the DiT's side:
h3serve/services/dit/hold.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from h3serve.services.dit import hold
from h3serve.v1 import gateway_pb2

# The denoise step an armed `dit_hold` keeps a job at, and a small job that is mid-denoise there (its 8 steps send 7
# step events: 5 are still to come).
HOLD_STEP = 2
HELD = dict(height=32, width=64, num_inference_steps=8)


class DitHold:
    """The tests' side of the DiT's hold point (h3serve/services/dit/hold.py): inside `armed()`, a job that reaches
    HOLD_STEP waits there until the block ends or its client cancels, so a kill or a cancel made after seeing its
    event for that step (`holds`) provably lands mid-denoise, where a long CPU run only made it likely."""

    def __init__(self, point: hold.Hold) -> None:
        self.point = point

    @contextmanager
    def armed(self) -> Iterator[None]:
        self.point.gate.touch()
        try:
            yield
        finally:
            self.release()

    def release(self) -> None:
        """Let a held job go on now, and the jobs after it run through (inside `armed()` too)."""
        self.point.gate.unlink(missing_ok=True)

    @staticmethod
    def holds(event: gateway_pb2.JobEvent) -> bool:
        """Whether `event` is its job's step at the hold: armed, the job waits there."""
        return event.HasField("denoising") and event.denoising.step == HOLD_STEP
