"""The MP4 muxer's x264 presets: encode time and quality (PSNR against the raw frames) on this machine's CPU.

The VAE service muxes on the CPU while the decoder runs (h3serve/services/vae/mux.py), so what a clip waits
for after the last decoder call is the encode of its last frames plus the audio. Each `--presets` entry
encodes the same uint8 frames of a `--sizes` clip with `Muxer` (libx264 at its default CRF 23, AAC audio)
and the MP4 is decoded back: PSNR of the decoded RGB frames against the frames that went in, and the file
size. Two kinds of frames (`--content`):
- `noise`: uniform random levels, what the random-weight decoder of the benches emits (x264's worst case);
- `scene`: a smooth synthetic scene (moving gradients and shapes), nearer what a trained model emits.
The baseline is the muxer's default preset (`medium`) in the same run; ratio = its seconds / the preset's.

    python -m bench.mux --sizes 768x1344x124 --content scene,noise --write
    python -m bench.mux --quick                                           # a small clip, two presets
    python -m bench.mux --same-bytes 600 --sizes 32x64x124 --content noise  # one x264 thread: how often the
                                                                          # same frames give other bytes (no row)
"""

from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import io
import os
import platform
import time

import av
import numpy as np

from bench.common import Size
from bench.results import Record, add_output_arguments, command_line, update_results
from h3serve.services.vae.mux import PRESET, THREADS, Muxer

SAMPLE_RATE = 32000


def frames_of(content: str, size: Size) -> np.ndarray:
    """(F, H, W, 3) uint8 frames of `content`, the same for every run."""
    if content == "noise":
        return np.random.default_rng(0).integers(0, 256, (size.frames, size.height, size.width, 3), dtype=np.uint8)
    y, x = np.mgrid[0 : size.height, 0 : size.width].astype(np.float32)
    clip = np.empty((size.frames, size.height, size.width, 3), dtype=np.uint8)
    for t in range(size.frames):
        cx, cy = size.width * (0.2 + 0.6 * t / size.frames), size.height * (0.5 + 0.3 * np.sin(t / 9))
        disc = ((x - cx) ** 2 + (y - cy) ** 2 < (size.height / 6) ** 2).astype(np.float32)
        clip[t, ..., 0] = 255 * (0.5 + 0.5 * np.sin(x / 57 + t / 11)) * (1 - disc) + 230 * disc
        clip[t, ..., 1] = 255 * (0.5 + 0.5 * np.cos(y / 43 - t / 13)) * (1 - disc) + 90 * disc
        clip[t, ..., 2] = 128 + 100 * np.sin((x + y) / 97 + t / 7)
    return clip


def encode(frames: np.ndarray, preset: str, threads: int = THREADS) -> tuple[float, bytes]:
    audio = np.random.default_rng(0).uniform(-0.5, 0.5, (2, SAMPLE_RATE * len(frames) // 24)).astype(np.float32)
    started = time.perf_counter()
    shape = (len(frames), frames.shape[1], frames.shape[2])
    with Muxer(*shape, SAMPLE_RATE, 2, lambda *_: None, preset, threads) as muxer:
        for first in range(0, len(frames), 17):  # the decoder's chunk of frames
            muxer.add(frames[first : first + 17])
        video = muxer.finish(audio)
    return time.perf_counter() - started, video


def psnr(video: bytes, frames: np.ndarray) -> float:
    with av.open(io.BytesIO(video)) as container:
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])])
    error = np.mean((decoded.astype(np.float64) - frames) ** 2)
    return float("inf") if error == 0 else 10 * np.log10(255**2 / error)


def same_bytes(frames: np.ndarray, count: int) -> collections.Counter:
    """Encode `frames` `count` times with one x264 thread (what [vae] x264_threads = 1 promises the same bytes for),
    as the VAE service does (`Muxer`, the decoder's chunks); prints how many files of each kind came out."""
    files = collections.Counter(hashlib.sha256(encode(frames, PRESET, 1)[1]).hexdigest()[:12] for _ in range(count))
    print(f"{count} encodes of the same {len(frames)} frames, one x264 thread: {len(files)} files: {dict(files)}")
    return files


def main(argv: list[str] | None = None) -> list[Record]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a 240x416x124 clip, presets medium and veryfast")
    p.add_argument("--sizes", default="768x1344x124,480x832x124")
    p.add_argument("--content", default="scene,noise")
    p.add_argument("--presets", default="medium,fast,faster,veryfast,superfast,ultrafast")
    p.add_argument("--same-bytes", type=int, default=0, help="encode the first clip this often with one x264 thread")
    add_output_arguments(p)
    args = p.parse_args(argv)
    if args.same_bytes:
        same_bytes(frames_of(args.content.split(",")[0], Size.parse(args.sizes.split(",")[0])), args.same_bytes)
        return []
    if args.quick:
        args.sizes, args.presets = "240x416x124", "medium,veryfast"
    presets = args.presets.split(",")
    if presets[0] != PRESET:
        presets.insert(0, PRESET)  # the baseline, timed first
    device = f"cpu ({os.cpu_count()} cores, {platform.machine()})"
    records = []
    print(f"{'clip':26} {'preset':10} {'seconds':>8} {'ratio':>6} {'PSNR dB':>8} {'MB':>7}")
    for size in (Size.parse(s) for s in args.sizes.split(",")):
        for content in args.content.split(","):
            frames = frames_of(content, size)
            base = None
            for preset in presets:
                seconds, video = encode(frames, preset)
                base = base or seconds
                quality = psnr(video, frames)
                print(
                    f"{f'{size} {content}':26} {preset:10} {seconds:8.2f} {base / seconds:6.2f} {quality:8.2f} "
                    f"{len(video) / 1e6:7.2f}",
                    flush=True,
                )
                records.append(
                    Record(
                        name=f"mux_{size}_{content}",
                        device=device,
                        world_size=1,
                        dtype="uint8",
                        seconds=seconds,
                        baseline_seconds=base,
                        ratio=base / seconds,
                        peak_gib=0.0,
                        command=command_line("bench.mux", argv),
                        date=datetime.date.today().isoformat(),
                        variant=f"libx264 preset {preset}, CRF 23: PSNR {quality:.2f} dB, {len(video) / 1e6:.2f} MB",
                        baseline=f"the muxer's default, preset {PRESET}",
                        software=f"PyAV {av.__version__}",
                    )
                )
    if args.write:
        update_results(records, args.results, args.markdown)
    return records


if __name__ == "__main__":
    main()
