"""The request flags `generate`, `reference` and `demo` share: prompt, canvas, steps, adapters, shifts, media files,
and the GenerateRequest they make."""

from __future__ import annotations

import argparse

from h3serve.cli import generate_help


class _OrderedMedia(argparse.Action):
    """Collects --first-frame / --last-frame / --ref-* as (flag, path) pairs in command-line order."""

    def __call__(self, parser, namespace, value, option_string=None):
        namespace.media = [*(getattr(namespace, "media", None) or []), (self.dest, value)]


def request(args):
    """The GenerateRequest the flags describe (media files are attached after upload, see cli/generate.py)."""
    from h3serve.v1 import common_pb2, gateway_pb2

    def given(name):
        return getattr(args, name, None)

    params = common_pb2.GenerationParams(
        num_inference_steps=args.steps or 0,
        include_raw=bool(given("raw")),
        adapters=args.adapter,
        flow_shift=args.flow_shift,
        audio_flow_shift=args.audio_flow_shift,
    )
    if given("seed") is not None:
        params.seed = args.seed
    return gateway_pb2.GenerateRequest(
        prompt=args.prompt,
        height=args.height or 0,
        width=args.width or 0,
        num_frames=given("num_frames") or 0,
        seconds=given("seconds") or 0.0,
        params=params,
        request_id=given("request_id") or "",
    )


def add_request_args(p: argparse.ArgumentParser, steps: int | None, height=None, width=None) -> None:
    p.add_argument("--prompt", default="a red fox trotting through fresh snow, wind in the pines")
    p.add_argument("--height", type=int, default=height, help=generate_help.canvas(height, width))
    p.add_argument("--width", type=int, default=width, help="see --height")
    p.add_argument("--steps", type=int, default=steps, help="num_inference_steps (N gives N-1 denoise steps)")
    p.add_argument(
        "--adapter",
        action="append",
        type=_adapter,
        default=[],
        metavar="NAME[:WEIGHT]",
        help="a LoRA adapter of the DiT's [dit] adapters, weight 1 by default (repeatable, in order)",
    )
    p.add_argument("--flow-shift", type=float, help="the video schedule's shift (default: an adapter's, else 12)")
    p.add_argument("--audio-flow-shift", type=float, help="the audio schedule's shift (default: an adapter's, else 3)")
    p.add_argument(
        "--out",
        help="file or directory for the MP4 (default: h3-<job id>.mp4 in the current directory; the demo uses out/)",
    )


def _adapter(text: str):
    from h3serve.model import adapters

    try:
        return adapters.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_media_args(p: argparse.ArgumentParser) -> None:
    for flag, what in (
        ("first-frame", "fl2va: image the video starts from"),
        ("last-frame", "fl2va: image the video ends on"),
        ("ref-image", "ref2va: an image reference, <Picture i> in the prompt (repeatable)"),
        ("ref-video", "ref2va: a video reference (its sound too), <Video k> (repeatable)"),
        ("ref-audio", "ref2va: an audio reference, <Audio j> (repeatable)"),
    ):
        p.add_argument(f"--{flag}", action=_OrderedMedia, metavar="FILE", help=what)
    p.set_defaults(media=[])
