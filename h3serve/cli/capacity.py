"""`h3serve capacity`: the deployment's admission table, what each canvas admits in packed rows and frames, before a
request is sent."""

from __future__ import annotations

from h3serve.common.config import load_deploy
from h3serve.model import rules


def _run(args) -> None:
    """The table (each entry bounded by max_rows too), then max_rows, which bounds every request."""
    from h3serve.gateway.admission.capacity import CapacityTable

    gateway = load_deploy(args.config).gateway
    table = CapacityTable(gateway.capacity, gateway.max_rows)
    rows = table.table(args.text_rows)
    assumed = f"text {args.text_rows} rows, no conditioning"
    if rows:
        print(f"{'workflow':<9} {'canvas':<10} {'max rows':>9}  max frames ({assumed}; canvas: height x width)")
    else:
        print("no capacity table in this deployment ([gateway] capacity): max_rows alone bounds a request")
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


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("capacity", help="print the deployment's admission table: max rows and frames per canvas")
    p.add_argument("--config")
    p.add_argument("--text-rows", type=int, default=256, help="prompt rows assumed for the frame ceiling")
    p.set_defaults(run=_run)
