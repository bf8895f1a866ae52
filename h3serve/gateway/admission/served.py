"""Which workflows this deployment serves: what its DiT replicas' Info RPC says, probed like health.

A DiT loads only the transformer partitions of its configured workflows, so a ref2va job sent to a
t2va-only DiT would fail at denoise after the encode phase. Submit asks the DiT replicas instead (each
answer cached at most 1 s, each probe bounded by a 1 s deadline, never a flag remembered from start-up)
and refuses a workflow none of them serves. A DiT process that answers while it exits (state "stopping" or
"failed: ...") says nothing either. When no replica says anything, nothing is known: the request is
accepted and queues until a DiT is back, as any other.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from h3serve.gateway.stages.replicas import HEALTH_TTL_S, PROBE_TIMEOUT_S, Replica, ReplicaSet
from h3serve.model import workflows as registry
from h3serve.v1 import common_pb2, dit_pb2_grpc

# DiTInfo.state of a group whose process is exiting: it was told to stop, or it failed ("failed: <reason>").
STOPPING_STATE, FAILED_STATE = "stopping", "failed"


class WorkflowNotServed(Exception):
    """The deployment's DiT replicas are up and none of them serves the request's workflow."""


class ServedWorkflows:
    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas
        self._answers: dict[str, tuple[float, frozenset[int] | None]] = {}

    async def _probe(self, replica: Replica) -> frozenset[int] | None:
        probed_at, workflows = self._answers.get(replica.address, (-HEALTH_TTL_S - 1, None))
        if time.monotonic() - probed_at <= HEALTH_TTL_S:
            return workflows
        try:
            info = await dit_pb2_grpc.DiTStub(replica.channel).Info(common_pb2.InfoRequest(), timeout=PROBE_TIMEOUT_S)
            exiting = info.state == STOPPING_STATE or info.state.startswith(FAILED_STATE)
            workflows = None if exiting else frozenset(info.workflows) or None  # empty: an Info that says nothing
        except grpc.aio.AioRpcError:
            workflows = None
        self._answers[replica.address] = (time.monotonic(), workflows)
        return workflows

    async def served(self) -> frozenset[int] | None:
        """The workflows of every DiT replica that answered; None when none answered."""
        answers = [a for a in await asyncio.gather(*(self._probe(r) for r in self.replicas.replicas)) if a]
        return frozenset().union(*answers) if answers else None

    async def check(self, workflow: int) -> None:
        served = await self.served()
        if served is not None and workflow not in served:
            names = ", ".join(registry.by_value(w).name for w in sorted(served))
            raise WorkflowNotServed(f"workflow: this deployment serves {names}; its DiT replicas do not load "
                                    f"{registry.by_value(workflow).name} (the [dit] workflows setting)")
