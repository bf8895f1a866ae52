"""The request flags `generate`, `reference` and `demo` share: prompt, canvas, steps, adapters, shifts, media files,
and the GenerateRequest they make."""

from __future__ import annotations

import argparse
from pathlib import Path

from h3serve.cli import generate_help
from h3serve.model import adapters, options


class _OrderedMedia(argparse.Action):
    """Collects --first-frame / --last-frame / --ref-* as (flag, path) pairs in command-line order."""

    def __call__(self, parser, namespace, value, option_string=None):
        namespace.media = [*(getattr(namespace, "media", None) or []), (self.dest, value)]


def option_values(args) -> dict[str, object]:
    """The request options the flags set, by GenerationParams field (include_raw: whether --raw names a file)."""
    values = {option.name: getattr(args, option.name, None) for option in options.OPTIONS if option.cli}
    return {**values, "include_raw": bool(getattr(args, "raw", None))}


def prompt(args) -> str:
    """--prompt-file's text (a prompt of any size never travels through exec's arguments), else --prompt."""
    if not args.prompt_file:
        return args.prompt
    try:
        return Path(args.prompt_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"h3serve: --prompt-file {args.prompt_file}: {exc}") from None


def request(args):
    """The GenerateRequest the flags describe (media files are attached after upload, see cli/generate.py)."""
    from h3serve.v1 import gateway_pb2

    def given(name):
        return getattr(args, name, None)

    return gateway_pb2.GenerateRequest(
        prompt=prompt(args),
        height=args.height or 0,
        width=args.width or 0,
        num_frames=given("num_frames") or 0,
        seconds=given("seconds") or 0.0,
        params=options.params(option_values(args)),
        request_id=given("request_id") or "",
    )


def add_request_args(p: argparse.ArgumentParser, steps: int | None, height=None, width=None, required=()) -> None:
    """The prompt, the canvas, and a flag per request option of h3serve/model/options.py (`required`: by name)."""
    prompts = p.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", default="a red fox trotting through fresh snow, wind in the pines")
    prompts.add_argument("--prompt-file", metavar="PATH", help="read the prompt from this UTF-8 file, used verbatim")
    p.add_argument("--height", type=int, default=height, help=generate_help.canvas(height, width))
    p.add_argument("--width", type=int, default=width, help="see --height")
    for option in options.OPTIONS:
        if not option.cli:
            continue
        if option.repeated:
            p.add_argument(
                option.flag,
                dest=option.name,
                help=option.help,
                action="append",
                type=_adapter,
                default=[],
                metavar="NAME[:WEIGHT]",
            )
        else:
            p.add_argument(
                option.flag,
                dest=option.name,
                help=option.help,
                type=option.type,
                required=option.name in required,
                metavar=option.flag.removeprefix("--").upper().replace("-", "_"),
            )
    p.set_defaults(num_inference_steps=steps)
    p.add_argument(
        "--out",
        help="file or directory for the MP4 (default: h3-<job id>.mp4 in the current directory; the demo uses out/)",
    )


def _adapter(text: str):
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
