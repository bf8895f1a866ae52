"""`h3serve plan --config F`: each GPU's predicted memory for a deployment file, before anything loads.

Arithmetic from parameter counts (h3serve/model/memory_plan.py): no torch, no GPU. A placement that cannot
fit is refused with exit status 2 and one line per problem on stderr, naming the GPU, the processes and the
numbers.
"""

from __future__ import annotations

import argparse
import sys

from h3serve.common.config import load_deploy

REFUSED = 2


def _canvas(text: str) -> tuple[int, int]:
    height, _, width = text.partition("x")
    if not (height.isdigit() and width.isdigit()):
        raise argparse.ArgumentTypeError(f"a canvas is HxW, e.g. 768x1344, got {text!r}")
    return int(height), int(width)


def _run(args) -> None:
    from h3serve.model import memory_plan

    config = load_deploy(args.config)
    result = memory_plan.plan(config, gpu_gib=args.gpu_gib, canvas=args.canvas, frames=args.frames,
                              text_rows=args.text_rows)
    print(f"plan for {args.config}")
    print("\n".join(result.lines()), flush=True)
    if result.problems:
        print("\n".join(f"h3serve plan: {problem}" for problem in result.problems), file=sys.stderr)
        raise SystemExit(REFUSED)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="predict each GPU's memory for a deployment; exit 2 if it cannot fit")
    p.add_argument("--config", required=True, help="deployment TOML file")
    p.add_argument("--gpu-gib", type=float, help="every GPU's size in GiB (default: the memory_limit_gib of the "
                                                  "services on it)")
    p.add_argument("--canvas", type=_canvas, metavar="HxW",
                   help="plan for this canvas (default: the deployment's default canvas, the largest it serves)")
    p.add_argument("--frames", type=int, help="plan for this many frames (default: the most admission lets through)")
    p.add_argument("--text-rows", type=int, default=256, help="prompt rows assumed in the packed sequence")
    p.set_defaults(run=_run)
