"""The HTTP door fuzzed from its own OpenAPI schema (schemathesis): over a thousand generated requests across its
operations, against a real gateway process on loopback, and not one answer is a server error.

The gateway runs alone (its stages down), so a valid create only queues a job; the queue's bound is small, so the
full-queue 429 is reached too. Two 503s tell the truth and are the only ones allowed: `/healthz` while the stages are
down, and a create naming adapters while no DiT replica can check them (`UNAVAILABLE`, "try again"). Every other
answer is below 500, and every 4xx is OpenAI's error JSON.
"""

from __future__ import annotations

import pytest
import schemathesis
from deployments import write_config
from hypothesis import HealthCheck, given, settings

from h3serve.cli.launcher import ServiceGroup, is_answering
from h3serve.common.config import load_deploy
from h3serve.common.free_ports import free_port

pytestmark = [pytest.mark.gateway, pytest.mark.slow, pytest.mark.processes]
EXAMPLES = 150  # per operation with inputs; the total is checked below
TRUTHFUL_503 = ("no DiT replica is serving now",)


@pytest.fixture(scope="module")
def door(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("schema")
    ports = {name: free_port() for name in ("encoder", "dit", "vae", "gateway", "http")}
    path = write_config(
        root / "deploy.toml",
        str(tiny_model_dir),
        root / "gateway",
        ports,
        http_port=ports["http"],
        max_unfinished_jobs=4,
    )
    with ServiceGroup(load_deploy(path), str(path), log_dir=str(root), names=("gateway",), ready=is_answering):
        yield f"http://127.0.0.1:{ports['http']}", root


def _checked(case, response) -> str:
    """The answer's status, asserted: below 500 (or a truthful 503), a 4xx in OpenAI's error shape."""
    status = response.status_code
    where = (
        f"{case.method} {case.formatted_path} {case.query or ''} {str(case.body)[:200]} -> {status} "
        f"{response.text[:300]}"
    )
    if status == 503:
        assert case.path == "/healthz" or any(mark in response.text for mark in TRUTHFUL_503), where
    else:
        assert status < 500, where
    if 400 <= status < 500:
        error = response.json()["error"]
        assert {"message", "type", "param", "code"} <= set(error), where
        assert response.headers.get("x-should-retry") == (["true"] if status == 429 else ["false"]), where
    return str(status)


def test_no_generated_request_gets_a_server_error(door):
    base_url, root = door
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/v1/videos",
        "/v1/videos/{video_id}",
        "/v1/assets",
        "/v1/videos/{video_id}/events",
        "/v1/videos/{video_id}/content",
    }
    generated, statuses = 0, {}
    for operation in operations:

        @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def run(case):
            nonlocal generated
            generated += 1
            response = case.call(base_url=base_url, timeout=30)
            seen = _checked(case, response)
            # run() is called below, within this iteration: `operation` is the one its strategy was drawn for
            statuses.setdefault(f"{operation.method.upper()} {operation.path}", set()).add(seen)  # noqa: B023

        run()
    print(generated, statuses)
    assert generated >= 1000, (generated, statuses)
    assert "Traceback" not in (root / "gateway.log").read_text()
