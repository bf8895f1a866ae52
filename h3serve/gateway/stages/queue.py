"""One stage's queue and workers: jobs wait in FIFO order for one of the stage's worker slots.

Each stage has its own queue, so a job waiting for the DiT never holds the encoder or the VAE: while
the DiT denoises job k, the VAE decodes job k-1 and the encoder encodes job k+1.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class StageQueue:
    def __init__(self, stage: str, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"{stage}: at least one worker is required, got {workers}")
        self.stage, self.workers = stage, workers
        self.busy = 0
        self._waiting: deque[asyncio.Future] = deque()

    @property
    def depth(self) -> int:
        """Jobs waiting for a worker."""
        return len(self._waiting)

    @asynccontextmanager
    async def worker(self) -> AsyncIterator[None]:
        """Hold one worker slot for the block; waits in FIFO order when all are busy."""
        if self.busy < self.workers and not self._waiting:
            self.busy += 1
        else:
            turn = asyncio.get_running_loop().create_future()
            self._waiting.append(turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():
                    self._release()  # the slot was handed over just as this job was cancelled
                else:
                    self._waiting.remove(turn)
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        """Hand the slot to the next waiter (busy stays), or free it."""
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.busy -= 1
