"""What this deployment's DiT serves: the workflows and the adapters its replicas' Info RPC reports, probed like
health.

A DiT loads only the transformer partitions of its configured workflows, so a ref2va job sent to a
t2va-only DiT would fail at denoise after the encode phase. Submit asks the DiT replicas instead (each
answer cached at most 1 s, each probe bounded by a 1 s deadline, never a flag remembered from start-up)
and refuses a workflow none of them serves. The same answer lists the adapters the DiT loaded, which the
request's adapters are resolved against (h3serve/model/adapters.py); replicas should load the same ones. A
DiT process that answers while it exits (state "stopping" or "failed: ...") says nothing either. When no
replica says anything, nothing is known: the request is accepted and queues until a DiT is back, as any
other, unless it names adapters, which cannot be resolved then, nor while the replicas are still loading
(`offer` or its `adapters` is None; Submit says UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc

from h3serve.gateway.stages.replicas import HEALTH_TTL_S, PROBE_TIMEOUT_S, Replica, ReplicaSet
from h3serve.model import workflows as registry
from h3serve.model.adapters import AdapterCatalog
from h3serve.v1 import common_pb2, dit_pb2_grpc

# DiTInfo.state of a group whose process is exiting: it was told to stop, or it failed ("failed: <reason>"); and of
# one whose ranks have loaded everything (until then its Info lists no adapters).
STOPPING_STATE, FAILED_STATE, SERVING_STATE = "stopping", "failed", "serving"


class WorkflowNotServed(Exception):
    """The deployment's DiT replicas are up and none of them serves the request's workflow."""


class AdaptersUnknown(Exception):
    """The request names adapters and no DiT replica is serving to say which it loaded."""


@dataclass(frozen=True)
class DiTOffer:
    """What the answering DiT replicas serve together; `adapters` is None until one of them has loaded its own."""

    workflows: frozenset[int]
    adapters: AdapterCatalog | None

    def merged(self, other: DiTOffer) -> DiTOffer:
        mine, theirs = self.adapters, other.adapters
        adapters = theirs if mine is None else mine if theirs is None else mine.merged(theirs)
        return DiTOffer(self.workflows | other.workflows, adapters)


class ServedWorkflows:
    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas
        self._answers: dict[str, tuple[float, DiTOffer | None]] = {}

    async def _probe(self, replica: Replica) -> DiTOffer | None:
        probed_at, offer = self._answers.get(replica.address, (-HEALTH_TTL_S - 1, None))
        if time.monotonic() - probed_at <= HEALTH_TTL_S:
            return offer
        try:
            info = await dit_pb2_grpc.DiTStub(replica.channel).Info(common_pb2.InfoRequest(), timeout=PROBE_TIMEOUT_S)
            exiting = info.state == STOPPING_STATE or info.state.startswith(FAILED_STATE)
            catalog = AdapterCatalog.from_info(info) if info.state == SERVING_STATE else None
            says_nothing = exiting or not info.workflows  # empty workflows: an Info that says nothing
            offer = None if says_nothing else DiTOffer(frozenset(info.workflows), catalog)
        except grpc.aio.AioRpcError:
            offer = None
        self._answers[replica.address] = (time.monotonic(), offer)
        return offer

    async def offer(self) -> DiTOffer | None:
        """What every DiT replica that answered serves, together; None when none answered."""
        answers = [a for a in await asyncio.gather(*(self._probe(r) for r in self.replicas.replicas)) if a]
        if not answers:
            return None
        offer = answers[0]
        for other in answers[1:]:
            offer = offer.merged(other)
        return offer

    @staticmethod
    def check(workflow: int, offer: DiTOffer | None) -> None:
        if offer is not None and workflow not in offer.workflows:
            names = ", ".join(registry.by_value(w).name for w in sorted(offer.workflows))
            raise WorkflowNotServed(
                f"workflow: this deployment serves {names}; its DiT replicas do not load "
                f"{registry.by_value(workflow).name} (the [dit] workflows setting)"
            )
