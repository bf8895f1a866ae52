"""Tenants (issue 51, item 7): each client reaches only its own jobs and uploads, through every door, an admin every
client's; another client's id answers exactly as an id never made; a client's own bound on unfinished jobs; tokens
added by `h3serve token add` and a SIGHUP, without a restart; reflection, the OpenAPI document and the metrics
behind the token.

The clients file's rules and the guard's decisions in-process; the doors against a real gateway process whose stages
are down (its jobs stay queued, which is all ownership needs), through gRPC, the HTTP door, its Server-Sent Events and
the openai SDK."""

from __future__ import annotations

import argparse
import http.client
import os
import signal
import sqlite3
from contextlib import closing

import grpc
import openai
import pytest
from deployments import write_config
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from stores import with_store
from up_process import wait_until

from bench.media_files import image
from h3serve.cli import token as token_cli
from h3serve.cli.launcher import ServiceGroup
from h3serve.client import GatewayClient
from h3serve.common.config import GatewayConfig, load_deploy
from h3serve.common.free_ports import free_port
from h3serve.common.server import is_answering
from h3serve.gateway.jobs.store import Ownership
from h3serve.gateway.tenants.clients import DEFAULT, ClientsFileError, entry, new_token, read, token_hash
from h3serve.gateway.tenants.registry import Tenants
from h3serve.gateway.webhooks.signing import new_secret
from h3serve.v1 import common_pb2
from h3serve.v1 import gateway_pb2 as S

SMALL = dict(height=32, width=64, num_inference_steps=2)
MISSING_JOB = "0123456789abcdef"  # an id of the same length as the gateway's, never made
ADMIN, BOUNDED = "root", "carol"
WEBHOOK_HOSTS = ("hooks.example", ".internal.example")  # the gateway fixture's [gateway] webhook_hosts


# The clients file and the guard's decisions, in-process.


def _clients_file(path, **clients) -> dict[str, str]:
    """Write a clients file with a fresh token per client (keys: entry()'s); returns the tokens by name."""
    tokens = {name: new_token() for name in clients}
    path.write_text("\n".join(entry(name, tokens[name], **keys) for name, keys in clients.items()))
    return tokens


def test_the_clients_file_keeps_only_hashes_and_refuses_what_it_cannot_use(tmp_path):
    path = tmp_path / "clients.toml"
    tokens = _clients_file(path, alice={}, root={"admin": True})
    text = path.read_text()
    assert tokens["alice"] not in text and token_hash(tokens["alice"]) in text
    clients = read(path)
    assert {c.name: c.admin for c in clients.values()} == {"alice": False, "root": True}

    def refused(body: str) -> str:
        path.write_text(body)
        with pytest.raises(ClientsFileError) as error:
            read(path)
        return str(error.value)

    digest = token_hash("t")
    assert refused(f'[clients.{DEFAULT}]\ntoken_sha256 = "{digest}"\n').endswith(
        f"and not {DEFAULT!r} ([gateway] auth_token's client)"
    )
    assert refused('[clients.a]\ntoken_sha256 = "abc"\n').startswith(
        f"clients file {path} [clients.a] token_sha256: String should match pattern"
    )
    assert refused(f'[clients.a]\ntoken_sha256 = "{digest}"\n[clients.b]\ntoken_sha256 = "{digest}"\n') == (
        f"clients file {path} [clients.b] token_sha256: the same token as [clients.a]"
    )
    assert refused(f'[clients.a]\ntoken_sha256 = "{digest}"\nwebhook_url = "https://example.com/h"\n') == (
        f"clients file {path} [clients.a] webhook_url: needs a webhook_secret to sign its events"
    )
    assert refused(f'[clients.a]\ntoken_sha256 = "{digest}"\nwebhook_secret = "s3cret"\n') == (
        f"clients file {path} [clients.a] webhook_secret: a webhook secret starts with 'whsec_' "
        "(`h3serve token add` makes one)"
    )


def test_the_guard_names_each_caller_keeps_the_old_clients_on_a_bad_reload_and_opens_only_what_is_set(tmp_path):
    path = tmp_path / "clients.toml"
    tokens = _clients_file(path, alice={})
    tenants = Tenants(GatewayConfig(clients_file=str(path), auth_token="legacy"))
    get_job, reflection = "/h3serve.v1.Gateway/GetJob", "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    local, remote = "ipv4:127.0.0.1:5000", "ipv4:10.1.2.3:5000"

    def caller(token: str | None, method: str = get_job, peer: str = remote) -> str | None:
        found = tenants.identify(method, f"Bearer {token}" if token else None, peer)
        return found.name if found else None

    assert [caller(tokens["alice"]), caller("legacy"), caller("wrong"), caller(None)] == ["alice", DEFAULT, None, None]
    assert caller(None, "/grpc.health.v1.Health/Check") == DEFAULT
    # the default: reflection open on loopback only (gRPC's peer names, IPv6 quoted)
    assert [caller(None, reflection, local), caller(None, reflection, remote)] == [DEFAULT, None]
    for peer in ("ipv6:%5B::1%5D:5000", "ipv6:%5B::ffff:127.0.0.1%5D:5000", "unix:/run/h3.sock"):
        assert caller(None, reflection, peer) == DEFAULT, peer
    assert caller(None, reflection, "ipv6:%5B2001:db8::1%5D:5000") is None

    path.write_text("not toml [")
    assert not tenants.reload()
    assert caller(tokens["alice"]) == "alice", "a file that cannot be used leaves the clients as they were"
    assert Tenants(GatewayConfig()).identify(get_job, None, remote).name == DEFAULT, "no token set: open, as before"
    closed = Tenants(GatewayConfig(auth_token="legacy", open_without_token=()))
    assert closed.identify(reflection, None, local) is None
    assert not closed.docs_allowed(None, "127.0.0.1") and closed.docs_allowed("Bearer legacy", "10.1.2.3")
    opened = Tenants(GatewayConfig(auth_token="legacy", open_without_token=("docs",)))
    assert opened.docs_allowed(None, "10.1.2.3")
    # metrics: on loopback by default, else only with an admin's token
    assert [tenants.metrics_allowed(None, host) for host in ("127.0.0.1", "::1", "10.1.2.3")] == [True, True, False]
    assert not tenants.metrics_allowed("Bearer legacy", "10.1.2.3")


def test_a_store_from_before_tenants_gives_its_jobs_to_the_default_client_and_request_ids_become_per_client(tmp_path):
    path = tmp_path / "jobs.sqlite"
    request = S.ResolvedRequest(prompt="an old fox")

    async def before(store):
        await store.submit("old", request, request_id="rid", digest="d")

    with_store(path, before)
    with closing(sqlite3.connect(path)) as conn, conn:  # the file as a gateway from before tenants left it
        conn.execute("DROP INDEX jobs_by_owner_request_id")
        conn.execute("ALTER TABLE jobs DROP COLUMN owner")
        conn.execute("ALTER TABLE jobs DROP COLUMN webhook_url")
        conn.execute("CREATE UNIQUE INDEX jobs_by_request_id ON jobs (request_id) WHERE request_id IS NOT NULL")

    async def after(store):
        assert (await store.get_job("old")).client == DEFAULT
        assert await store.get_job("old", client="alice") is None
        again, created = await store.submit("new", request, request_id="rid", digest="d")
        assert (again.job_id, created) == ("old", False), "the default client's retry finds its job"
        theirs, created = await store.submit("alices", request, request_id="rid", digest="d", owner=Ownership("alice"))
        assert (theirs.job_id, theirs.client, created) == ("alices", "alice", True)
        listed, _ = await store.list_jobs([], 10, client="alice")
        assert [job.job_id for job in listed] == ["alices"]

    with_store(path, after)


# Every door of a real gateway process.


class Gateway:
    def __init__(self, group: ServiceGroup, ports: dict[str, int], tokens: dict[str, str], clients_file) -> None:
        self.group, self.ports, self.tokens, self.clients_file = group, ports, tokens, clients_file
        self.port, self.http_port = ports["gateway"], ports["http"]

    @property
    def pid(self) -> int:
        return self.group.running[0].process.pid

    def client(self, name: str | None) -> GatewayClient:
        return GatewayClient(f"127.0.0.1:{self.port}", token=self.tokens[name] if name else None)

    def sdk(self, name: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.http_port}/v1", api_key=self.tokens[name], max_retries=0)

    def get(self, path: str, name: str | None = None, lines: int = 0, port: str = "http") -> tuple[int, str]:
        """GET `path` on the HTTP door (or the `port` named) with `name`'s token (None: no token): the status and the
        body, or only its first `lines` lines (an event stream that goes on)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.ports[port], timeout=30)
        try:
            connection.request("GET", path, headers={"authorization": f"Bearer {self.tokens[name]}"} if name else {})
            response = connection.getresponse()
            if not lines:
                return response.status, response.read().decode()
            return response.status, "".join(response.readline().decode() for _ in range(lines))
        finally:
            connection.close()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """A gateway with a legacy auth_token (the default client), alice and bob (the per-client bound: 5), carol (her
    own bound: 1) and an admin, nothing open without a token (metrics included); its stages are ports nobody
    listens on."""
    root = tmp_path_factory.mktemp("tenants")
    clients_file = root / "clients.toml"
    tokens = _clients_file(clients_file, alice={}, bob={}, root={"admin": True}, dora={"webhook_secret": new_secret()})
    tokens[BOUNDED] = new_token()
    with clients_file.open("a") as file:
        file.write(entry(BOUNDED, tokens[BOUNDED]) + "max_unfinished_jobs = 1\n")
    tokens[DEFAULT] = "legacy-token"
    ports = {name: free_port() for name in ("encoder", "dit", "vae", "gateway", "http", "metrics")}
    config = write_config(
        root / "deploy.toml",
        "",
        root / "gateway",
        ports,
        auth_token=tokens[DEFAULT],
        clients_file=str(clients_file),
        max_unfinished_jobs_per_client=5,
        open_without_token=[],
        webhook_hosts=list(WEBHOOK_HOSTS),
        http_port=ports["http"],
        metrics_port=ports["metrics"],
    )
    group = ServiceGroup(load_deploy(config), str(config), log_dir=str(root), names=("gateway",), ready=is_answering)
    with group:
        yield Gateway(group, ports, tokens, clients_file)


def _submit(gateway: Gateway, name: str, prompt: str, **fields) -> S.Job:
    with gateway.client(name) as client:
        return client.stub.Submit(S.GenerateRequest(prompt=prompt, **SMALL, **fields))


def _refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value


def _not_found_as_if_missing(call, job_id: str) -> None:
    """`call(id)` answers NOT_FOUND for `job_id`, word for word as for an id never made."""
    other, missing = _refusal(lambda: call(job_id)), _refusal(lambda: call(MISSING_JOB))
    assert other.code() == missing.code() == grpc.StatusCode.NOT_FOUND
    assert other.details().replace(job_id, "ID") == missing.details().replace(MISSING_JOB, "ID")


@pytest.mark.processes
def test_over_grpc_each_client_reaches_only_its_own_jobs_and_the_admin_every_one(gateway):
    alice = _submit(gateway, "alice", "alice's fox", request_id="shared-id")
    bob = _submit(gateway, "bob", "bob's fox", request_id="shared-id")  # the same id names bob's own job
    legacy = _submit(gateway, DEFAULT, "the old token's fox")
    assert alice.job_id != bob.job_id and (alice.client, bob.client, legacy.client) == ("alice", "bob", DEFAULT)
    assert _submit(gateway, "alice", "alice's fox", request_id="shared-id").job_id == alice.job_id

    with gateway.client("alice") as client:
        stub = client.stub
        for call in (
            lambda job_id: stub.GetJob(S.GetJobRequest(job_id=job_id)),
            lambda job_id: next(iter(stub.Watch(S.WatchRequest(job_id=job_id)))),
            lambda job_id: stub.CancelJob(S.CancelJobRequest(job_id=job_id)),
            lambda job_id: stub.DeleteJob(S.DeleteJobRequest(job_id=job_id)),
            lambda job_id: stub.RestoreJob(S.RestoreJobRequest(job_id=job_id)),
            lambda job_id: stub.ListJobs(S.ListJobsRequest(after_job_id=job_id)),
        ):
            _not_found_as_if_missing(call, bob.job_id)
        listed = list(stub.ListJobs(S.ListJobsRequest()).jobs)
        assert alice.job_id in {job.job_id for job in listed} and {job.client for job in listed} == {"alice"}
        assert next(iter(stub.Watch(S.WatchRequest(job_id=alice.job_id)))).HasField("accepted")
    with gateway.client(DEFAULT) as client:
        assert {job.job_id for job in client.stub.ListJobs(S.ListJobsRequest()).jobs} == {legacy.job_id}
        assert client.stub.Info(common_pb2.InfoRequest()).unfinished_jobs == 1, "its own only"
    with gateway.client(ADMIN) as client:
        seen = {job.job_id for job in client.stub.ListJobs(S.ListJobsRequest()).jobs}
        assert {alice.job_id, bob.job_id, legacy.job_id} <= seen
        assert client.stub.GetJob(S.GetJobRequest(job_id=bob.job_id)).client == "bob"
    with gateway.client("bob") as client:  # bob's job was never touched by alice's calls
        untouched = client.stub.GetJob(S.GetJobRequest(job_id=bob.job_id))
        assert untouched.state in (S.JOB_STATE_QUEUED, S.JOB_STATE_RUNNING) and not untouched.deleted


@pytest.mark.processes
def test_over_http_sse_and_the_openai_sdk_each_client_sees_only_its_own_videos(gateway):
    alice_sdk, bob_sdk = gateway.sdk("alice"), gateway.sdk("bob")
    mine = alice_sdk.videos.create(prompt="alice over http", size="64x32", extra_body={"steps": 2})
    theirs = bob_sdk.videos.create(prompt="bob over http", size="64x32", extra_body={"steps": 2})
    listed = [video.id for video in alice_sdk.videos.list()]
    assert mine.id in listed and theirs.id not in listed
    assert alice_sdk.videos.retrieve(mine.id).status in ("queued", "in_progress")
    for call in (alice_sdk.videos.retrieve, alice_sdk.videos.delete, alice_sdk.videos.download_content):
        with pytest.raises(openai.NotFoundError) as other:
            call(theirs.id)
        with pytest.raises(openai.NotFoundError) as missing:
            call(MISSING_JOB)
        assert str(other.value).replace(theirs.id, "ID") == str(missing.value).replace(MISSING_JOB, "ID")
    assert {mine.id, theirs.id} <= {video.id for video in gateway.sdk(ADMIN).videos.list()}

    assert gateway.get(f"/v1/videos/{mine.id}/events", "alice", lines=2) == (200, "id: 1\nevent: accepted\n")
    other, missing = (gateway.get(f"/v1/videos/{job_id}/events", "alice") for job_id in (theirs.id, MISSING_JOB))
    assert other[0] == missing[0] == 404 and other[1].replace(theirs.id, "ID") == missing[1].replace(MISSING_JOB, "ID")
    assert gateway.get("/v1/videos")[0] == 401


@pytest.mark.processes
def test_an_upload_is_its_uploaders_alone_until_another_client_uploads_the_same_bytes(gateway, tmp_path):
    picture = image(tmp_path / "alice.png", 64, 32, seed=5)
    with gateway.client("alice") as alice, gateway.client("bob") as bob:
        uploaded = alice.upload(picture)
        assert not uploaded.deduplicated and alice.upload(picture).deduplicated
        unknown = "f" * 64
        other = _refusal(lambda: bob.stub.Submit(S.GenerateRequest(prompt="p", first_frame=uploaded.asset_id)))
        missing = _refusal(lambda: bob.stub.Submit(S.GenerateRequest(prompt="p", first_frame=unknown)))
        assert other.code() == missing.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert other.details().replace(uploaded.asset_id, "ID") == missing.details().replace(unknown, "ID")
        picture.rename(tmp_path / "bob.png")
        again = bob.upload(tmp_path / "bob.png")  # bob has the bytes himself: now they are his too
        assert (again.asset_id, again.deduplicated, again.file_name) == (uploaded.asset_id, False, "bob.png")
        job = bob.stub.Submit(S.GenerateRequest(prompt="bob's keyframe", first_frame=uploaded.asset_id))
        assert job.request.first_frame == uploaded.asset_id


@pytest.mark.processes
def test_a_client_over_its_own_bound_is_refused_and_the_others_are_not(gateway):
    _submit(gateway, BOUNDED, "carol's one")
    refused = _refusal(lambda: _submit(gateway, BOUNDED, "carol's two"))
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"client {BOUNDED!r} has 1 unfinished jobs, the bound is 1" in refused.details()
    assert _submit(gateway, "alice", "alice is not held back").client == "alice"


@pytest.mark.processes
def test_a_requests_own_webhook_url_is_refused_when_it_is_no_endpoint_or_its_client_cannot_sign_or_post_there(gateway):
    """A request may name its own endpoint (docs/webhooks.md): one that is no http(s) URL or carries credentials is
    refused with the rule; a valid one from a client without a webhook_secret (alice) is refused, since its events
    could not be signed; one on a host outside [gateway] webhook_hosts is refused for a client with a secret (dora),
    one under an allowed ".name" is hers. The same refusals over gRPC and the HTTP door; nothing refused is queued."""
    allowed = ", ".join(WEBHOOK_HOSTS)
    cases = {
        (
            "alice",
            "ftp://hooks.example/h",
        ): "webhook_url: an absolute http:// or https:// URL, got 'ftp://hooks.example/h'",
        ("alice", "https://me:pw@hooks.example/h"): "webhook_url: no user or password in the URL",
        ("alice", "https://hooks.example/h"): "webhook_url: client 'alice' has no webhook_secret in the clients file",
        ("dora", "https://10.0.0.1/h"): f"webhook_url: host '10.0.0.1' is not one this gateway posts to "
        f"([gateway] webhook_hosts: {allowed})",
        ("dora", "https://internal.example/h"): "webhook_url: host 'internal.example' is not one",
    }
    for name in ("alice", "dora"):
        with gateway.client(name) as client:
            before = len(client.stub.ListJobs(S.ListJobsRequest()).jobs)
            for url, reason in ((url, reason) for (who, url), reason in cases.items() if who == name):
                refused = _refusal(lambda url=url, name=name: _submit(gateway, name, "a hooked fox", webhook_url=url))
                assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in refused.details()
                with pytest.raises(openai.BadRequestError) as http_refused:
                    gateway.sdk(name).videos.create(
                        prompt="a hooked fox", size="64x32", extra_body={"webhook_url": url}
                    )
                assert reason in str(http_refused.value)
            assert len(client.stub.ListJobs(S.ListJobsRequest()).jobs) == before
    hooked = _submit(gateway, "dora", "a hooked fox", webhook_url="https://Hooks.a.Internal.example/h")
    assert hooked.webhook.url == "https://Hooks.a.Internal.example/h"


@pytest.mark.processes
def test_a_token_added_by_the_cli_works_after_a_sighup_without_a_restart(gateway, capsys):
    root = argparse.ArgumentParser()
    token_cli.add_parser(root.add_subparsers(dest="command"))
    args = root.parse_args(["token", "add", "dave", "--file", str(gateway.clients_file)])
    args.run(args)
    gateway.tokens["dave"] = capsys.readouterr().out.splitlines()[0]
    pid = gateway.pid
    with gateway.client("dave") as dave:
        refused = _refusal(lambda: dave.stub.ListJobs(S.ListJobsRequest()))
        assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
        os.kill(pid, signal.SIGHUP)

        def listed():
            try:
                return dave.stub.ListJobs(S.ListJobsRequest()) is not None
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED
                return False

        wait_until(listed, 30, "dave's token accepted after the SIGHUP")
        assert _submit(gateway, "dave", "dave's first").client == "dave"
    assert gateway.pid == pid and gateway.group.running[0].process.poll() is None, "no restart"


@pytest.mark.processes
def test_reflection_the_api_document_and_metrics_sit_behind_the_token_and_health_stays_open(gateway):
    def services(token: str | None) -> list[str]:
        with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            metadata = (("authorization", f"Bearer {token}"),) if token else ()
            reply = next(
                stub.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=metadata
                )
            )
            return [service.name for service in reply.list_services_response.service]

    assert _refusal(lambda: services(None)).code() == grpc.StatusCode.UNAUTHENTICATED
    assert "h3serve.v1.Gateway" in services(gateway.tokens["alice"])
    assert [gateway.get(path)[0] for path in ("/openapi.json", "/docs")] == [401, 401]
    assert gateway.get("/openapi.json", "alice")[0] == 200
    assert gateway.get("/healthz")[0] == 503, "health answers without a token (the stages are down: 503)"
    scrapes = {name: gateway.get("/metrics", name, port="metrics") for name in (None, "alice", ADMIN)}
    assert [scrapes[name][0] for name in (None, "alice")] == [401, 401], "every client's counts: an admin's only"
    assert scrapes[ADMIN][0] == 200 and "h3serve_jobs{" in scrapes[ADMIN][1]
