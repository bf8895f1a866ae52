"""Wall time of each workflow through the whole stack with the tiny model on CPU.

Starts encoder, DiT, VAE and gateway as processes (the reference geometry shrunk through the pipeline
configs, as the CPU tests do), makes its own small media, uploads it, and runs t2va, fl2va (first +
last keyframe) and ref2va (video with sound + image + audio) twice each: the first run of a workflow
pays its cold caches, the second is warm (a new seed, the encoder cache missed by a new prompt).

    python -m bench.workflows [--steps 8]
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import time
from pathlib import Path

from h3serve.cli.launcher import ServiceGroup
from h3serve.client import GatewayClient
from h3serve.common.config import load_deploy
from h3serve.model.rules import Geometry
from h3serve.runtime.tiny import write_tiny_model
from h3serve.v1 import gateway_pb2
from tests.media_files import image, mp4, wav

GEOMETRY = Geometry(canvas_short_edge=32, canvas_max_pixels=2048, reference_image_short_edge=64)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(root: Path) -> Path:
    model = write_tiny_model(root / "tiny-h3")
    ports = {name: _port() for name in ("encoder", "dit", "vae", "gateway")}
    lines = [f'[model]\ndir = "{model}"', *(f"{k} = {v}" for k, v in GEOMETRY.pipeline_configs().items())]
    lines += [f"\n[{name}]\nport = {ports[name]}" for name in ("encoder", "dit", "vae")]
    lines.append(f'\n[gateway]\nport = {ports["gateway"]}\ndata_dir = "{root / "gateway"}"')
    path = root / "deploy.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _requests(client: GatewayClient, media: Path, steps: int) -> dict[str, gateway_pb2.GenerateRequest]:
    first, last = client.upload(image(media / "first.png", 48, 32, seed=1)), client.upload(
        image(media / "last.png", 48, 32, seed=2))
    refs = [client.upload(mp4(media / "clip.mp4", 64, 36, 30, seed=3)),
            client.upload(image(media / "ref.png", 40, 30, seed=4)), client.upload(wav(media / "voice.wav", 2.0))]
    common = dict(height=32, width=64, num_inference_steps=steps)
    return {
        "t2va": gateway_pb2.GenerateRequest(prompt="a kite over the dunes", **common),
        "fl2va": gateway_pb2.GenerateRequest(prompt="<Picture 1> melts into <Picture 2>", first_frame=first.asset_id,
                                             last_frame=last.asset_id, **common),
        "ref2va": gateway_pb2.GenerateRequest(
            prompt="<Picture 1> dances to <Audio 2> like <Video 1>", **common,
            references=[gateway_pb2.ReferenceInput(asset_id=r.asset_id) for r in refs]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="h3-bench-") as tmp:
        root = Path(tmp)
        config = _config(root)
        with ServiceGroup(load_deploy(config), str(config), log_dir=str(root)):
            deploy = load_deploy(config)
            client = GatewayClient(f"127.0.0.1:{deploy.gateway.port}")
            (root / "media").mkdir()
            for name, request in _requests(client, root / "media", args.steps).items():
                for run in ("cold", "warm"):
                    request.seed, request.prompt = len(run), request.prompt + " ."
                    started = time.perf_counter()
                    final = client.generate(request)
                    wall = time.perf_counter() - started
                    assert final.WhichOneof("kind") == "done", final
                    stages = "  ".join(f"{s.stage} {s.seconds:.2f} s" for s in client.job(final.job_id).stages)
                    print(f"{name:7s} {run}: {wall:6.2f} s   {stages}", flush=True)
            client.close()


if __name__ == "__main__":
    main()
