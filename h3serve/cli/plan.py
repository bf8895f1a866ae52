"""`h3serve plan --config F`: each GPU's and the host's predicted memory for a deployment file, before anything loads.

Arithmetic from parameter counts (h3serve/common/memory_plan.py): no torch, no GPU. A placement that cannot
fit is refused with exit status 2 and one line per problem on stderr, naming the GPU or the host, the processes
and the numbers. The host's size: --host-gib, else `[supervisor] host_memory_gib`, else this machine's MemTotal.
"""

from __future__ import annotations

import argparse
import sys

from h3serve.common.config import load_deploy
from h3serve.common.processes import GIB, MEMINFO, read_meminfo

REFUSED = 2


def _canvas(text: str) -> tuple[int, int]:
    height, _, width = text.partition("x")
    if not (height.isdigit() and width.isdigit()):
        raise argparse.ArgumentTypeError(f"a canvas is HxW, e.g. 768x1344, got {text!r}")
    return int(height), int(width)


def host_size(flag: float | None, configured: float, meminfo: str = MEMINFO) -> tuple[float | None, str]:
    """The host's GiB and where the number comes from: the flag, the deployment file, else the machine."""
    if flag:
        return flag, "--host-gib"
    if configured:
        return configured, "[supervisor] host_memory_gib"
    found = read_meminfo(meminfo)
    return (found.total / GIB, "MemTotal of this machine") if found else (None, "")


def _run(args) -> None:
    from h3serve.common import memory_plan
    from h3serve.common.ceilings import Ceilings

    config = load_deploy(args.config)
    host_gib, source = host_size(args.host_gib, config.supervisor.host_memory_gib)
    ceilings = Ceilings(config, args.gpu_gib, args.text_rows)  # the largest request admission lets through
    result = memory_plan.plan(
        config,
        gpu_gib=args.gpu_gib,
        canvas=args.canvas,
        frames=args.frames or ceilings.largest_frames(args.canvas),
        text_rows=args.text_rows,
        host_gib=host_gib,
        host_source=source,
    )
    print(f"plan for {args.config}")
    lines = result.lines()  # the verdict stays last, after the ceilings
    print("\n".join(lines[:-1] + ceilings.lines() + lines[-1:]), flush=True)
    if result.problems:
        print("\n".join(f"h3serve plan: {problem}" for problem in result.problems), file=sys.stderr)
        raise SystemExit(REFUSED)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="predict each GPU's memory for a deployment; exit 2 if it cannot fit")
    p.add_argument("--config", required=True, help="deployment TOML file")
    p.add_argument(
        "--gpu-gib",
        type=float,
        help="every GPU's size in GiB (default: [supervisor] gpu_memory_gib, else the largest memory_limit_gib on it)",
    )
    p.add_argument(
        "--canvas",
        type=_canvas,
        metavar="HxW",
        help="plan for this canvas (default: the deployment's default canvas, the largest it serves)",
    )
    p.add_argument("--frames", type=int, help="plan for this many frames (default: the most admission lets through)")
    p.add_argument(
        "--host-gib",
        type=float,
        help="the host's memory in GiB (default: [supervisor] host_memory_gib, else this machine's MemTotal)",
    )
    p.add_argument("--text-rows", type=int, default=256, help="prompt rows assumed in the packed sequence")
    p.set_defaults(run=_run)
