"""`h3serve write-tiny DIR`: the built-in tiny model saved in the released diffusers layout, for a deployment file's
[model] dir on a machine without the real weights."""

from __future__ import annotations


def _run(args) -> None:
    from h3serve.runtime.tiny import write_tiny_model

    print(write_tiny_model(args.directory).resolve())


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("write-tiny", help="save the built-in tiny model in the released diffusers layout")
    p.add_argument("directory")
    p.set_defaults(run=_run)
