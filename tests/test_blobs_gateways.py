"""Two real gateways on one PostgreSQL store and one blob directory, with the tiny model's services: an asset
uploaded to A serves a job submitted to B; the artifact downloads from either, over gRPC and HTTP, bytes equal; the
store holds blob keys, not paths; and an artifact a gateway from before keys recorded by its local path is served
by both after their start migrates the row."""

from __future__ import annotations

import hashlib
import urllib.request
from pathlib import Path

import psycopg
import pytest
import stores
from deployments import QUICK_OUTAGE, write_config
from test_blobs import downgrade

from bench.media_files import image
from h3serve.cli.launcher import ServiceGroup
from h3serve.client import GatewayClient
from h3serve.common.config import load_deploy
from h3serve.common.free_ports import free_port
from h3serve.common.server import is_answering
from h3serve.gateway.jobs.gateway_id import FILE_NAME
from h3serve.model.rules import Geometry
from h3serve.v1 import gateway_pb2

pytestmark = pytest.mark.processes

S = gateway_pb2
postgres = stores.postgres  # fixture
GEOMETRY = Geometry(canvas_short_edge=32, canvas_max_pixels=2048, reference_image_short_edge=64)
OLD_CLIP = b"a clip from before blob keys"


class Gateway:
    def __init__(self, data_dir: Path, port: int, http_port: int):
        self.data_dir, self.port, self.http_port = data_dir, port, http_port

    def client(self) -> GatewayClient:
        return GatewayClient(f"127.0.0.1:{self.port}")

    def http_content(self, job_id: str) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/v1/videos/{job_id}/content") as answer:
            return answer.read()

    @property
    def id(self) -> str:
        return (self.data_dir / FILE_NAME).read_text().strip()


@pytest.fixture(scope="module")
def two_gateways(postgres, tmp_path_factory, tiny_model_dir):
    """A (with the model services) keeps blobs in its data_dir, as one gateway always has; B has a data_dir of its
    own and points blob_dir at A's (the shared filesystem). The database already holds an old job whose artifact row
    records its local path under A's data_dir, as the release before blob keys wrote it."""
    root = tmp_path_factory.mktemp("two-gateways")
    url = postgres.new_database()
    a_dir, b_dir = root / "a", root / "b"
    old_path = a_dir / "artifacts" / "h3-old.mp4"
    old_path.parent.mkdir(parents=True)
    old_path.write_bytes(OLD_CLIP)
    (root / "b-logs").mkdir()
    stores.Backend("postgresql", url).run(_old_job)
    downgrade(url, str(old_path))

    services = {name: free_port() for name in ("encoder", "dit", "vae")}
    gateways, configs = [], []
    for name, data_dir, blob_dir in (("a", a_dir, ""), ("b", b_dir, str(a_dir))):
        ports = {**services, "gateway": free_port(), "http": free_port()}
        configs.append(
            write_config(
                root / f"{name}.toml",
                str(tiny_model_dir),
                data_dir,
                ports,
                model=GEOMETRY.pipeline_configs(),
                outage_s=QUICK_OUTAGE,
                store_url=url,
                blob_dir=blob_dir,
                http_port=ports["http"],
            )
        )
        gateways.append(Gateway(data_dir, ports["gateway"], ports["http"]))
    a_config, b_config = configs
    with (
        ServiceGroup(load_deploy(a_config), str(a_config), log_dir=str(root)),
        ServiceGroup(
            load_deploy(b_config), str(b_config), log_dir=str(root / "b-logs"), names=("gateway",), ready=is_answering
        ),
    ):
        yield (*gateways, url)


async def _old_job(store) -> None:
    await store.submit("old", S.ResolvedRequest(prompt="from before"))
    await store.finish("old", S.JOB_STATE_SUCCEEDED, S.JobEvent(done=S.Done()))
    artifact = S.Artifact(
        artifact_id="old-video",
        file_name="h3-old.mp4",
        bytes=len(OLD_CLIP),
        sha256=hashlib.sha256(OLD_CLIP).hexdigest(),
        media_type="video/mp4",
    )
    await store.add_artifact("old", "video", artifact, "unused")


def _downloaded(gateway: Gateway, artifact_id: str, into: Path) -> bytes:
    with gateway.client() as client:
        return client.download(artifact_id, into / f"{gateway.port}-{artifact_id}").read_bytes()


def _stored(url: str, query: str) -> list[tuple]:
    with psycopg.connect(url) as conn:
        return conn.execute(query).fetchall()


def test_an_asset_uploaded_to_a_serves_a_job_submitted_to_b_whose_artifact_both_serve(two_gateways, tmp_path):
    a, b, url = two_gateways
    with a.client() as client:
        picture = client.upload(image(tmp_path / "a.png", 48, 32, seed=3)).asset_id
    request = S.GenerateRequest(prompt="<Picture 1> waves", height=32, width=64, num_inference_steps=2)
    request.references.add(asset_id=picture)
    with b.client() as client:
        job_id = client.submit(request).job_id
        *_, final = client.events(job_id)
        assert final.WhichOneof("kind") == "done", final
        job = client.job(job_id)
    assert _stored(url, f"SELECT lease_owner, fence FROM jobs WHERE job_id = '{job_id}'") == [(b.id, 1)], (
        "B claimed it once and ran it: it read A's upload from the shared blobs"
    )

    video = job.artifacts[0]
    assert video.media_type == "video/mp4"
    on_a, on_b = _downloaded(a, video.artifact_id, tmp_path), _downloaded(b, video.artifact_id, tmp_path)
    assert on_a == on_b and hashlib.sha256(on_a).hexdigest() == video.sha256 and len(on_a) == video.bytes
    assert a.http_content(job_id) == b.http_content(job_id) == on_a
    keys = _stored(url, f"SELECT blob_key FROM artifacts WHERE job_id = '{job_id}'")
    assert keys == [(f"artifacts/h3-{job_id}.mp4",)], "a key, never a path"


def test_an_old_rows_local_path_became_a_key_and_both_gateways_serve_it(two_gateways, tmp_path):
    a, b, url = two_gateways
    assert _stored(url, "SELECT blob_key FROM artifacts WHERE job_id = 'old'") == [("artifacts/h3-old.mp4",)]
    assert _downloaded(a, "old-video", tmp_path) == _downloaded(b, "old-video", tmp_path) == OLD_CLIP
    assert a.http_content("old") == b.http_content("old") == OLD_CLIP
