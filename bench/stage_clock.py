"""Per-stage times of an in-process modular pipeline: each top-level block is timed where it runs.

`MiniMaxH3Blocks` runs its top-level blocks (set-up, text encoder, VAE encoder, denoise, decode) in
order; wrapping the named ones leaves the pipeline's own call path and outputs unchanged, and the
device is synchronised at each boundary so a block's queued GPU work is counted in that block.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class _TimedBlock:
    """Calls the wrapped block and adds its wall time to `clock`; everything else is the block's own."""

    def __init__(self, block, stage: str, clock: StageClock) -> None:
        self._block, self._stage, self._clock = block, stage, clock

    def __call__(self, components, state):
        synchronize(self._clock.device)
        started = time.perf_counter()
        result = self._block(components, state)
        synchronize(self._clock.device)
        self._clock.seconds[self._stage] += time.perf_counter() - started
        return result

    def __getattr__(self, name: str):
        return getattr(self._block, name)


class StageClock:
    """Times `stages` ({top-level block name: stage name}) of `pipe` on every call; `reset` between runs."""

    def __init__(self, pipe, stages: dict[str, str], device: str) -> None:
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        blocks = pipe._blocks.sub_blocks  # the blocks the pipeline runs (`pipe.blocks` is a copy)
        for name, stage in stages.items():
            blocks[name] = _TimedBlock(blocks[name], stage, self)

    def reset(self) -> None:
        self.seconds.clear()
