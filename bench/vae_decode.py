"""Video + audio VAE decode time and accuracy: diffusers' in-process decode block vs the VAE service's decoder.

Both run in one process on the same VAEs (full released size, random weights built on the GPU;
`--quick`: the tiny preset on CPU) and the same latents of a `--sizes` video. The baseline is
the in-process pipeline's decode block: video VAE (tiled as released), audio VAE, float frames to
numpy. Ours is the service's decode phase (`h3serve/services/vae/server.py::decode_checked`), exactly what
it pays before muxing: the same block, the output checks and the uint8 conversion on the device,
then uint8 frames and the audio to numpy. The baseline is timed first; then each `--variants` entry is
applied in order, each only adding to the one before (compile cannot be undone in place):
`attention[+compile][+dynamic][+fp8][+tiles=N]`, e.g. `native,native+tiles=28,_native_cudnn+compile+dynamic+tiles=28`,
where `tiles=N` decodes N spatial tiles per decoder call (h3serve/services/vae/tiles.py) and the others are the
fast path's (h3serve/runtime/fastpath.py; fp8: the ViT decoder's block linears). With `--errors`, the
frames of every run are compared with an fp32 decode of the same weights; with `--profile` each variant's GPU
time is printed by kernel group beside its wall time (bench/profile.py).

    python -m bench.vae_decode --sizes 768x1344x124 --variants native,native+tiles=28 --errors --write
    python -m bench.vae_decode --quick                                        # CPU smoke test
    python -m bench.vae_decode --quick --sizes 240x416x124 --repeats 5        # tiny VAEs on CPU, larger
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from dataclasses import dataclass

import torch

from bench import profile
from bench.accuracy import rel_l2, upcast_to_fp32
from bench.common import Size, add_variant_arguments, device_label, software, timed
from bench.dit_step import FastPathLadder, parse_variant
from bench.results import Record, add_output_arguments, command_line, update_results
from h3serve.runtime import fastpath, random_full
from h3serve.runtime.fastpath import FastPath
from h3serve.services.vae.decode import VaeDecoder, pixel_geometry
from h3serve.services.vae.server import decode_checked
from h3serve.services.vae.tiles import TileDecoder

AUDIO_LATENTS_PER_FRAME = 207 / 124  # 124 frames come with 207 audio latents


@dataclass(frozen=True)
class VaeVariant:
    fast: FastPath
    tile_batch: int = 1

    @classmethod
    def parse(cls, text: str) -> VaeVariant:
        """`attention[+compile][+dynamic][+fp8][+tiles=N]`: the fast path's options, and tiles per decoder call."""
        flags = text.split("+")
        tiles = [int(f.split("=", 1)[1]) for f in flags if f.startswith("tiles=")]
        fast = parse_variant("+".join(f for f in flags if not f.startswith("tiles=")))
        return cls(fast, tiles[0] if tiles else 1)

    def describe(self) -> str:
        return self.fast.describe() + (f"+tiles={self.tile_batch}" if self.tile_batch > 1 else "")


def vaes(quick: bool, device: str, dtype: torch.dtype) -> tuple:
    if quick:
        from h3serve.runtime.tiny import build_component

        return build_component("vae"), build_component("audio_vae")
    return random_full.build_component("vae", device, dtype), random_full.build_component("audio_vae", device, dtype)


def latents_for(size: Size, vae, audio_vae) -> tuple[torch.Tensor, torch.Tensor]:
    """Random latents that decode to `size` (5n + 2 latent frames, as the DiT produces them)."""
    ratio = vae.spatial_compression_ratio
    chunk, kept = vae.tokens_chunk_size, vae.tokens_chunk_size - vae.config.token_drop
    latent_frames = next(
        (
            chunk * n + kept
            for n in range(1, 1000)
            if pixel_geometry(vae, (1, 1, chunk * n + kept, 1, 1))[0] == size.frames
        ),
        None,
    )
    if latent_frames is None:
        raise SystemExit(f"--sizes {size}: the VAE decodes 17n+5 frames, not {size.frames}")
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(
        1, vae.config.latent_channels, latent_frames, size.height // ratio, size.width // ratio, generator=generator
    )
    audio = torch.randn(
        2, audio_vae.config.latent_channels, round(size.frames * AUDIO_LATENTS_PER_FRAME), generator=generator
    )
    return latents, audio


def run(size: Size, args, device: str) -> list[Record]:
    """Each size starts from the VAEs as released: the variants of the size before changed them in place, and the
    attention backend they chose is process-wide (cuDNN's runs no fp32 reference: "No available kernel")."""
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3DecodeStep

    vae, audio_vae = vaes(args.quick, device, getattr(torch, args.dtype))
    fastpath.set_attention(vae, "native")
    latents, audio = latents_for(size, vae, audio_vae)
    block = MiniMaxH3DecodeStep().init_pipeline()
    block.update_components(vae=vae, audio_vae=audio_vae)
    ours = VaeDecoder(vae, audio_vae)

    def baseline() -> torch.Tensor:
        out = block(latents=latents.to(device), audio_latents=audio.to(device), output_type="np", output=["videos"])
        return torch.from_numpy(out["videos"][0])

    def decode() -> torch.Tensor:
        return decode_checked(ours, latents, audio, lambda *_: None, lambda *_: None).decoded.frames

    reference = None
    if args.errors:
        with upcast_to_fp32(vae):
            reference = baseline()
    base_seconds, _, base_frames, _ = measure(baseline, args, device)
    records, ladder = [], FastPathLadder(vae)
    for variant in (VaeVariant.parse(v) for v in args.variants.split(",")):
        ladder.step_to(variant.fast)  # the service's own fast path, each variant adding to the one before
        TileDecoder(vae, variant.tile_batch)
        seconds, peak, frames, first = measure(decode, args, device)
        if args.profile:
            with torch.no_grad():
                rows = profile.kernels(decode)
            profile.print_breakdown(f"one decode, {size}, {variant.describe()} ({seconds:.3f} s wall)", rows, top=24)
        errors = (
            {}
            if reference is None
            else {"rel_err_fp32": rel_l2(frames.cpu(), reference), "bf16_rel_err_fp32": rel_l2(base_frames, reference)}
        )
        print(
            f"  {size} {variant.describe()}: {seconds:.3f} s (first call {first:.3f}) vs {base_seconds:.3f} {errors}",
            flush=True,
        )
        records.append(
            Record(
                name=f"vae_decode_{size}",
                device=device_label(device),
                world_size=1,
                dtype=str(args.dtype),
                seconds=seconds,
                baseline_seconds=base_seconds,
                ratio=base_seconds / seconds,
                peak_gib=peak,
                command=args.command,
                date=datetime.date.today().isoformat(),
                variant=f"VAE service decoder, {variant.describe()}",
                baseline="diffusers MiniMaxH3DecodeStep (native attention, tile by tile), in process",
                software=software(),
                **errors,
            )
        )
    return records


def measure(fn, args, device: str) -> tuple[float, float, torch.Tensor, float]:
    """(median seconds, peak GiB, float frames of the last call, seconds of the first call: a compile, cuDNN's
    set-up) after that first call."""
    last: dict[str, torch.Tensor] = {}

    def call() -> None:
        last["frames"] = fn()

    with torch.no_grad():
        first = timed(call, device)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        times = [timed(call, device) for _ in range(args.repeats)]
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else 0.0
    return statistics.median(times), round(peak, 2), last["frames"], first


def main(argv: list[str] | None = None) -> list[Record]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_variant_arguments(p, sizes="768x1344x124", repeats=2)
    p.add_argument("--profile", action="store_true", help="print each variant's kernel time breakdown (CUDA)")
    add_output_arguments(p)
    args = p.parse_args(argv)
    args.command = command_line("bench.vae_decode", argv)
    if args.quick:  # the tiny preset on CPU, at 32x64x22 unless --sizes says otherwise
        args.dtype = "float32"
        args.sizes = "32x64x22" if args.sizes == p.get_default("sizes") else args.sizes
    device = "cpu" if args.quick else "cuda"
    records = []
    for size in args.sizes.split(","):  # written as each size ends: a later size that fails keeps them
        done = run(Size.parse(size), args, device)
        for r in done:
            print(
                f"{r.name:26} {r.variant:48} {r.seconds:8.3f} s  diffusers {r.baseline_seconds:8.3f} s  "
                f"ratio {r.ratio:6.3f}  peak {r.peak_gib:6.2f} GiB"
            )
        if args.write:
            update_results(done, args.results, args.markdown)
        records += done
    return records


if __name__ == "__main__":
    main()
