"""Real processes made to fail: a stalled DiT (SIGSTOP) against the watchdog, the queue bound and health;
an encoder replica killed between jobs; auth and TLS on the public API."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
from deployments import QUICK_OUTAGE, write_config
from dit_holding import HELD
from grpc_health.v1 import health_pb2, health_pb2_grpc

from h3serve.cli.launcher import ServiceGroup
from h3serve.client import GatewayClient
from h3serve.common.config import load_deploy
from h3serve.common.free_ports import free_port
from h3serve.v1 import common_pb2, dit_pb2_grpc, gateway_pb2, gateway_pb2_grpc

pytestmark = [pytest.mark.gateway, pytest.mark.processes]
S = gateway_pb2
SMALL = dict(height=32, width=64, num_inference_steps=30)
STALL_S = 4.0


def group(root: Path, name: str, names: tuple[str, ...], model_dir, ports: dict[str, int], **gateway) -> ServiceGroup:
    config = write_config(
        root / f"{name}.toml", str(model_dir), root / name, ports, outage_s=QUICK_OUTAGE, retry_backoff_s=0.1, **gateway
    )
    return ServiceGroup(load_deploy(config), str(config), log_dir=str(root), names=names)


def process(group: ServiceGroup, name: str) -> subprocess.Popen:
    return next(item.process for item in group.running if item.name == name)


def dit_ranks(address: str) -> list[int]:
    """The DiT group's rank processes (the launcher's process is torchrun, which serves nothing itself)."""
    with grpc.insecure_channel(address) as channel:
        return [r.pid for r in dit_pb2_grpc.DiTStub(channel).Info(common_pb2.InfoRequest(), timeout=10).ranks]


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def wait_for_health(address: str, status: int, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while health(address) != status:
        assert time.monotonic() < deadline, f"health never became {status}"
        time.sleep(0.2)


class HealthWatch:
    """The statuses a health Watch stream sends, collected on a thread."""

    def __init__(self, address: str, service: str = "") -> None:
        self.channel = grpc.insecure_channel(address)
        self.stream = health_pb2_grpc.HealthStub(self.channel).Watch(health_pb2.HealthCheckRequest(service=service))
        self.statuses: list[int] = []
        self.thread = threading.Thread(target=self._collect, daemon=True)
        self.thread.start()

    def _collect(self) -> None:
        try:
            self.statuses.extend(response.status for response in self.stream)
        except grpc.RpcError:
            pass  # cancelled by close()

    def close(self) -> None:
        self.stream.cancel()
        self.thread.join(10)
        self.channel.close()


def test_a_stalled_dit_is_caught_by_the_watchdog_and_health_follows_it(stack, dit_hold, tmp_path):
    ports = {**stack.ports, "dit": free_port(), "gateway": free_port()}
    with group(
        tmp_path,
        "stall",
        ("dit", "gateway"),
        stack.model_dir,
        ports,
        max_attempts=2,
        max_unfinished_jobs=1,
        stall_s={"denoise": STALL_S},
    ):
        address = f"127.0.0.1:{ports['gateway']}"
        client = GatewayClient(address)
        ranks = dit_ranks(f"127.0.0.1:{ports['dit']}")
        watch = HealthWatch(address)
        try:
            # Held mid-denoise while its ranks are stopped; released while they are, so it goes on only at SIGCONT.
            with dit_hold.armed():
                job = client.stub.Submit(S.GenerateRequest(prompt="a stalled one", seed=4, **HELD))
                stream = client.stub.Watch(S.WatchRequest(job_id=job.job_id))
                next(e for e in stream if dit_hold.holds(e))
                stream.cancel()
                for pid in ranks:
                    os.kill(pid, signal.SIGSTOP)
            try:
                with pytest.raises(grpc.RpcError) as err:
                    client.stub.Submit(S.GenerateRequest(prompt="one too many", **SMALL))
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "1 unfinished jobs, the bound is 1" in err.value.details()
                # read before the health wait: a loaded machine's wait took past the retry's stall too (8 s after the
                # hold), and the job had failed by the time Info was read
                assert client.stub.Info(common_pb2.InfoRequest()).unfinished_jobs == 1
                wait_for_health(address, health_pb2.HealthCheckResponse.NOT_SERVING)  # after the 1 s cache at most
                info = client.stub.Info(common_pb2.InfoRequest())
                assert not info.serving
                healthy = {s.stage: [r.healthy for r in s.replicas] for s in info.stages}
                assert healthy == {"encoder": [True], "vae-encode": [True], "dit": [False], "vae": [True]}
                events = list(client.stub.Watch(S.WatchRequest(job_id=job.job_id)))
            finally:
                for pid in ranks:
                    os.kill(pid, signal.SIGCONT)
            kinds = [e.WhichOneof("kind") for e in events]
            assert kinds.count("retrying") == 1 and kinds[-1] == "failed"
            reason = f"stuck in denoise for {STALL_S:g} s"
            assert events[kinds.index("retrying")].retrying == S.Retrying(attempt=2, max_attempts=2, reason=reason)
            assert events[-1].failed.code_name == "DEADLINE_EXCEEDED"
            assert events[-1].failed.message == f"{reason} (attempt 2 of 2)"
            failed = client.job(job.job_id)
            assert failed.state == S.JOB_STATE_FAILED and failed.attempts == 2
            assert [r.error for r in failed.stage_records if r.stage == "dit"] == [reason, reason]

            wait_for_health(address, health_pb2.HealthCheckResponse.SERVING)  # the DiT is back
            final = client.generate(S.GenerateRequest(prompt="after the stall", seed=5, **SMALL))
            assert final.HasField("done")
            watch.close()
            serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
            assert watch.statuses == [serving, not_serving, serving], "Watch sent the status, then each change"
        finally:
            watch.close()
            client.close()


def test_health_watch_of_an_unknown_service_says_so_and_stays_open(stack):
    watch = HealthWatch(stack.address("gateway"), service="no.such.Service")
    try:
        deadline = time.monotonic() + 10
        while not watch.statuses:
            assert time.monotonic() < deadline, "no first status"
            time.sleep(0.05)
        assert watch.thread.is_alive(), "the call stays open"
    finally:
        watch.close()
    assert watch.statuses == [health_pb2.HealthCheckResponse.SERVICE_UNKNOWN]


def test_encode_moves_to_the_other_replica_when_one_dies(stack, tmp_path):
    ports_a = {**stack.ports, "encoder": free_port()}
    ports_b = {**stack.ports, "encoder": free_port(), "gateway": free_port()}
    replicas = [f"127.0.0.1:{ports_a['encoder']}", f"127.0.0.1:{ports_b['encoder']}"]
    with (
        group(tmp_path, "a", ("encoder",), stack.model_dir, ports_a) as a,
        group(tmp_path, "b", ("encoder", "gateway"), stack.model_dir, ports_b, encoder=replicas),
    ):
        client = GatewayClient(f"127.0.0.1:{ports_b['gateway']}")
        try:
            # The gateway may have probed replica b while it was still loading: wait until Info sees both up.
            deadline = time.monotonic() + 60
            while not all(r.healthy for r in client.stub.Info(common_pb2.InfoRequest()).stages[0].replicas):
                assert time.monotonic() < deadline, "encoder replicas never both healthy"
                time.sleep(0.2)
            warm = [
                client.generate(
                    S.GenerateRequest(prompt=f"warm {i}", seed=i, height=32, width=64, num_inference_steps=4)
                )
                for i in range(2)
            ]
            used = [client.job(final.job_id).stage_records[0].replica for final in warm]
            assert used == replicas, "least-loaded routing spreads the first two encodes"
            # Replica a stalls, takes the next encode (it looks healthy and ties on load), and dies with the
            # call in flight: the encode moves to replica b and the job does not fail.
            encoder_a = process(a, "encoder")
            os.kill(encoder_a.pid, signal.SIGSTOP)
            job = client.stub.Submit(
                S.GenerateRequest(prompt="during the kill", seed=9, height=32, width=64, num_inference_steps=4)
            )
            deadline = time.monotonic() + 60
            while client.stub.Info(common_pb2.InfoRequest()).stages[0].replicas[0].in_flight != 1:
                assert time.monotonic() < deadline, "the encode never reached replica a"
                time.sleep(0.1)
            encoder_a.kill()
            encoder_a.wait(30)
            final = list(client.stub.Watch(S.WatchRequest(job_id=job.job_id)))[-1]
            assert final.HasField("done"), final
            record = client.job(final.job_id).stage_records[0]
            assert (record.stage, record.tries, record.replica) == ("encoder", 2, replicas[1])
            info = client.stub.Info(common_pb2.InfoRequest())
            assert [(r.address, r.healthy) for r in info.stages[0].replicas] == [
                (replicas[0], False),
                (replicas[1], True),
            ]
            assert info.serving, "one healthy encoder replica is enough"
        finally:
            client.close()


def test_tls_on_every_server_and_a_bearer_token(stack, tmp_path, certificate):
    cert, key = certificate
    ports = {name: free_port() for name in ("encoder", "dit", "vae", "gateway")}
    config = write_config(
        tmp_path / "tls.toml",
        str(stack.model_dir),
        tmp_path / "tls",
        ports,
        service_keys=dict(tls_cert=str(cert), tls_key=str(key)),
        auth_token="s3cret",
        tls_cert=str(cert),
        tls_key=str(key),
        stage_tls_ca=str(cert),
    )
    with (
        ServiceGroup(load_deploy(config), str(config), log_dir=str(tmp_path)),
        grpc.secure_channel(
            f"127.0.0.1:{ports['gateway']}", grpc.ssl_channel_credentials(cert.read_bytes())
        ) as channel,
    ):
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = S.GenerateRequest(prompt="a locked door", seed=1, height=32, width=64, num_inference_steps=4)
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)):
            for call in (
                lambda metadata=metadata: stub.Submit(request, metadata=metadata),
                lambda metadata=metadata: list(stub.Watch(S.WatchRequest(job_id="x"), metadata=metadata)),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "Bearer" in err.value.details()
        good = (("authorization", "Bearer s3cret"),)
        final = list(stub.Generate(request, metadata=good))[-1]
        assert final.HasField("done"), final  # gateway -> encoder, DiT, VAE over TLS too
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING, "probes need no token"
        for name in ("gateway", "dit"):
            with grpc.insecure_channel(f"127.0.0.1:{ports[name]}") as plain:
                with pytest.raises(grpc.RpcError) as err:
                    health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, f"no plaintext on the {name}'s TLS port"
