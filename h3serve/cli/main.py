"""The `h3serve` command: serve one service, start them all, generate, compare with diffusers.

Each subcommand is a module of this package with an `add_parser(subparsers)`; this one assembles them and runs the
chosen one, turning a refused deployment file into its reasons instead of a traceback."""

from __future__ import annotations

import argparse

from h3serve.cli import (
    capacity,
    demo,
    experiment,
    generate,
    init,
    plan,
    reference_command,
    serve,
    token,
    up,
    write_tiny,
)
from h3serve.common.config import ConfigError

SUBCOMMANDS = (serve, up, generate, reference_command, write_tiny, capacity, demo, plan, init, token, experiment)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="h3serve", description=__doc__.split("\n")[0])
    sub = root.add_subparsers(dest="command", required=True)
    for command in SUBCOMMANDS:
        command.add_parser(sub)
    return root


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        args.run(args)
    except ConfigError as exc:  # a refused deployment file or flag: its reasons, not a traceback
        raise SystemExit(f"h3serve {args.command}: {exc}") from None


if __name__ == "__main__":
    main()
