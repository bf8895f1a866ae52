"""Stage concurrency with two gateways on one job store (issue 52, docs/capacity.md): each gateway bounds its own calls
(one in flight per replica of a stage), so two gateways have two DiT calls in flight at once; the bound that holds
for the whole deployment is the service's own, the DiT group running one request at a time and queueing the next.

Real processes: the test stack's model services, and gateways A and B on one PostgreSQL database. The DiT holds A's job
mid-denoise while A takes a second job and B one: A's waits in A, B's is sent and waits in the DiT's queue."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import stores
from deployments import QUICK_OUTAGE, STACK_MODEL, write_config
from dit_holding import HELD
from up_process import wait_until

from h3serve.cli.launcher import ServiceGroup
from h3serve.client import GatewayClient
from h3serve.common.config import load_deploy
from h3serve.common.free_ports import free_port
from h3serve.common.server import is_answering
from h3serve.v1 import common_pb2, dit_pb2_grpc, gateway_pb2

pytestmark = pytest.mark.processes

S = gateway_pb2
postgres = stores.postgres  # fixture


@dataclass
class TwoGateways:
    a: str  # gateway addresses
    b: str
    dit: dit_pb2_grpc.DiTStub
    store_url: str


@pytest.fixture(scope="module")
def two_gateways(tmp_path_factory, stack, postgres) -> Iterator[TwoGateways]:
    """Gateways A and B on one database, in front of the test stack's model services (whose DiT holds)."""
    root = tmp_path_factory.mktemp("two-gateways")
    store_url = postgres.new_database()
    ports = {name: stack.ports[name] for name in ("encoder", "dit", "vae")}
    configs = []
    for name in ("a", "b"):
        ports["gateway"] = free_port()
        configs.append(
            write_config(
                root / f"deploy-{name}.toml",
                str(stack.model_dir),
                root / f"gateway-{name}",
                ports,
                model=STACK_MODEL,
                outage_s=QUICK_OUTAGE,
                retry_backoff_s=0.1,
                store_url=store_url,
            )
        )
    a, b = (load_deploy(config) for config in configs)
    gateway = dict(names=("gateway",), ready=is_answering)
    with (
        ServiceGroup(a, str(configs[0]), log_dir=str(root / "a"), **gateway),
        ServiceGroup(b, str(configs[1]), log_dir=str(root / "b"), **gateway),
        grpc.insecure_channel(stack.address("dit")) as dit,
    ):
        yield TwoGateways(
            f"127.0.0.1:{a.gateway.port}", f"127.0.0.1:{b.gateway.port}", dit_pb2_grpc.DiTStub(dit), store_url
        )


def _until(client: GatewayClient, job_id: str, reached) -> None:
    """Return at the job's first event that `reached` says yes to (its earlier events included)."""
    for event in client.stub.Watch(S.WatchRequest(job_id=job_id)):
        if reached(event):
            return
    pytest.fail(f"job {job_id} ended first")


def _dit_record(client: GatewayClient, job_id: str) -> S.StageRecord:
    return next((r for r in client.job(job_id).stage_records if r.stage == "dit"), S.StageRecord())


def test_each_gateway_bounds_its_own_dit_calls_and_the_dit_runs_one_at_a_time(two_gateways, dit_hold):
    stored = stores.Backend("postgresql", two_gateways.store_url)
    served = two_gateways.dit.Info(common_pb2.InfoRequest()).requests_served
    with GatewayClient(two_gateways.a) as a, GatewayClient(two_gateways.b) as b:
        with dit_hold.armed():
            held = a.stub.Submit(S.GenerateRequest(prompt="held on A", **HELD, seed=1)).job_id
            _until(a, held, dit_hold.holds)
            behind = a.stub.Submit(S.GenerateRequest(prompt="behind it on A", **HELD, seed=2)).job_id
            sent = b.stub.Submit(S.GenerateRequest(prompt="sent by B meanwhile", **HELD, seed=3)).job_id
            wait_until(lambda: _dit_record(a, behind).enqueued > 0, 120, "A's second job in its DiT queue")
            wait_until(lambda: _dit_record(b, sent).started > 0, 120, "B's DiT call")

            # per gateway: A's one DiT worker (one replica) is taken by the held job, so its next job waits in A
            assert _dit_record(a, behind).started == 0
            # across gateways: B's call is in flight beside A's, and the DiT, one request at a time, queues it
            assert _dit_record(a, held).finished == 0 and _dit_record(b, sent).finished == 0
            events = stored.run(lambda store: store.events(sent))
            assert not [e for e in events if e.HasField("denoising")], "B's job has not started denoising"
            dit = two_gateways.dit.Info(common_pb2.InfoRequest())
            assert (dit.busy, dit.requests_served) == (True, served)

        ends = [
            list(client.stub.Watch(S.WatchRequest(job_id=job_id)))[-1]
            for client, job_id in ((a, held), (a, behind), (b, sent))
        ]
        jobs = [a.job(held), a.job(behind), b.job(sent)]
    assert [end.WhichOneof("kind") for end in ends] == ["done"] * 3
    assert [(job.state, job.attempts) for job in jobs] == [(S.JOB_STATE_SUCCEEDED, 1)] * 3
    assert two_gateways.dit.Info(common_pb2.InfoRequest()).requests_served == served + 3
