"""`h3serve capacity`: what the deployment admits before a request is sent: its hand-set table (packed rows and frames
per canvas) and max_rows, then the plan's ceilings (h3serve/common/ceilings.py), which bound every canvas the table
leaves out, as the gateway admits by them."""

from __future__ import annotations

from h3serve.common.config import load_deploy
from h3serve.model import rules


def _run(args) -> None:
    """The table (each entry bounded by max_rows too), then max_rows, which bounds every request, then the plan's
    ceilings on the deployment's own cards (as the gateway computes them)."""
    from h3serve.common.ceilings import Ceilings
    from h3serve.gateway.admission.capacity import CapacityTable

    config = load_deploy(args.config)
    gateway, ceilings = config.gateway, Ceilings(config, text_rows=args.text_rows)
    table = CapacityTable(gateway.capacity, gateway.max_rows)
    rows = table.table(args.text_rows)
    assumed = f"text {args.text_rows} rows, no conditioning"
    if rows:
        print(f"{'workflow':<9} {'canvas':<10} {'max rows':>9}  max frames ({assumed}; canvas: height x width)")
    else:
        bounds = "the plan's ceilings (below) and max_rows bound" if ceilings.bounded else "max_rows alone bounds"
        print(f"no capacity table in this deployment ([gateway] capacity): {bounds} a request")
    for workflow, canvas, limit, frames in rows:
        shown = "-" if canvas == "*" else (frames or "none fit")
        print(f"{workflow:<9} {canvas:<10} {limit:>9,}  {shown}")
    height, width = gateway.geometry.default_canvas
    frames = table.max_frames(gateway.max_rows, height, width, args.text_rows)
    fit = f"at most {frames} frames" if frames else f"no clip, not even {rules.VALID_NUM_FRAMES[0]} frames"
    print(
        f"every request: at most {gateway.max_rows:,} packed rows ([gateway] max_rows); at the default canvas "
        f"{height}x{width} (height x width): {fit} ({assumed})"
    )
    print("\n".join(ceilings.lines()))


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "capacity", help="print what the deployment admits: its table, max_rows and the plan's ceilings"
    )
    p.add_argument("--config")
    p.add_argument("--text-rows", type=int, default=256, help="prompt rows assumed for the frame ceiling")
    p.set_defaults(run=_run)
