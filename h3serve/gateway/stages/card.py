"""One card for every stage (`[gateway] stages_take_turns`): each stage call takes a turn on it, one at a time, in
arrival order.

Under `h3serve up` a turn also waits while a model service is starting on the card: `up` starts them one at a time
(h3serve/cli/launcher.py) because a start's load and warm-up beside another stage's work overflowed the card the plan
counts by turns, and a service it restarts later loads beside the stages serving unless their calls wait for it. The
waiting job hears which service it waits for and how long that one has to serve; a supervisor that is gone (or none)
holds nothing, and one whose start times out ends the wait, as `up` then restarts it or gives up.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from h3serve.common.supervision import STARTING, ServiceState, read_live
from h3serve.gateway.stages import SERVICES
from h3serve.gateway.stages.queue import StageQueue
from h3serve.gateway.stages.stage import JobContext
from h3serve.v1 import gateway_pb2

POLL_S = 0.5  # how soon a turn sees the service it waits for serving


class Card:
    def __init__(self, supervisor_state: str | None) -> None:
        self.queue = StageQueue("card", 1)
        self.supervisor_state = supervisor_state  # `up`'s state file, None without `up`

    @asynccontextmanager
    async def turn(self, job: JobContext, stage: str) -> AsyncIterator[None]:
        """The card for `job`'s call of `stage`, once no call holds it and no model service is starting on it."""
        async with self.queue.worker():
            await self._while_a_service_starts(job, stage)
            yield

    async def _while_a_service_starts(self, job: JobContext, stage: str) -> None:
        told: ServiceState | None = None
        while starting := await self._starting():
            name, service, start_timeout_s = starting
            if service != told:  # a state is the same until the next change
                told = service
                reason = f"the card is {name}'s while it starts: {service.describe(name, start_timeout_s)}"
                limit = round(service.left_s(start_timeout_s))
                await job.emit(waiting=gateway_pb2.Waiting(stage=stage, reason=reason, limit_s=limit))
            await asyncio.sleep(POLL_S)

    async def _starting(self) -> tuple[str, ServiceState, float] | None:
        """A model service `up` is starting now (name, state, its start timeout), if any."""
        live = await asyncio.to_thread(read_live, self.supervisor_state) if self.supervisor_state else None
        if live is None:
            return None
        return next(
            (
                (name, service, live.start_timeout_s)
                for name, service in live.services.items()
                if name in SERVICES and service.state == STARTING
            ),
            None,
        )
