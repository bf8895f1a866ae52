"""Wall time of each workflow through the whole stack with the tiny model on CPU.

Starts encoder, DiT, VAE and gateway as processes with the geometry ([model]), threads and default steps
of a deployment file (the demo's by default; on free ports, with the tiny model written to disk), makes its own small
media, uploads it, and runs t2va, fl2va (first + last keyframe) and ref2va (video with sound + image +
audio) twice each, without a size (and without steps unless --steps), so the deployment's defaults
apply: the first run of a workflow pays its cold caches, the second is warm (a new seed, the encoder
cache missed by a new prompt).

    python -m bench.workflows [--config docs/deploy/tiny-cpu.toml] [--steps N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.common import leaves_gpu_empty
from bench.deployment import DEMO, tiny_deployment
from bench.media_files import image, mp4, wav
from h3serve.cli.launcher import ServiceGroup
from h3serve.client import GatewayClient
from h3serve.common.config import load_deploy
from h3serve.v1 import common_pb2, gateway_pb2


def _requests(client: GatewayClient, media: Path, steps: int) -> dict[str, gateway_pb2.GenerateRequest]:
    first, last = (
        client.upload(image(media / "first.png", 48, 32, seed=1)),
        client.upload(image(media / "last.png", 48, 32, seed=2)),
    )
    refs = [
        client.upload(mp4(media / "clip.mp4", 64, 36, 30, seed=3)),
        client.upload(image(media / "ref.png", 40, 30, seed=4)),
        client.upload(wav(media / "voice.wav", 2.0)),
    ]
    common = dict(
        params=common_pb2.GenerationParams(num_inference_steps=steps)
    )  # no size: the deployment's canvas (fl2va: the first keyframe's aspect)
    return {
        "t2va": gateway_pb2.GenerateRequest(prompt="a kite over the dunes", **common),
        "fl2va": gateway_pb2.GenerateRequest(
            prompt="<Picture 1> melts into <Picture 2>", first_frame=first.asset_id, last_frame=last.asset_id, **common
        ),
        "ref2va": gateway_pb2.GenerateRequest(
            prompt="<Picture 1> dances to <Audio 2> like <Video 1>",
            **common,
            references=[gateway_pb2.ReferenceInput(asset_id=r.asset_id) for r in refs],
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEMO), help="deployment whose geometry, threads and steps apply")
    parser.add_argument("--steps", type=int, default=0, help="num_inference_steps (0: the deployment's default)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="h3-bench-") as tmp:
        root = Path(tmp)
        config = tiny_deployment(root, load_deploy(args.config))
        with leaves_gpu_empty(), ServiceGroup(load_deploy(config), str(config), log_dir=str(root)):
            deploy = load_deploy(config)
            client = GatewayClient(f"127.0.0.1:{deploy.gateway.port}")
            (root / "media").mkdir()
            for name, request in _requests(client, root / "media", args.steps).items():
                for run in ("cold", "warm"):
                    request.params.seed, request.prompt = len(run), request.prompt + " ."
                    started, events = time.perf_counter(), []
                    final = client.generate(request, events.append)
                    wall = time.perf_counter() - started
                    assert final.WhichOneof("kind") == "done", final
                    accepted = events[0].accepted.request
                    shape = f"{accepted.height}x{accepted.width} {accepted.params.num_inference_steps} steps"
                    stages = "  ".join(f"{s.stage} {s.seconds:.2f} s" for s in client.job(final.job_id).stages)
                    print(f"{name:7s} {run}: {wall:6.2f} s  {shape}   {stages}", flush=True)
            client.close()


if __name__ == "__main__":
    main()
