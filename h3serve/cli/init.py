"""`h3serve init`: write the fastest shipped deployment that fits this box, saying why, and what each request costs.

The box is read from this machine or a description file (h3serve/cli/box.py); the profile is chosen among the shipped
ones (h3serve/cli/profiles.py), set to the box's card, host and model directory, and written with the reasons and
the plan's ceilings as its header. `--dry-run` prints it instead. `h3serve plan --config FILE` checks what it wrote.
"""

from __future__ import annotations

from pathlib import Path

from h3serve.cli import box as boxes
from h3serve.cli import profiles

REFUSED = 2
TINY = "docs/deploy/tiny-cpu.toml"  # the demo's: not among the profiles, as it serves no released model


def report(box: boxes.Box, verdicts: list[profiles.Verdict]) -> list[str]:
    """Why the chosen profile, why none ahead of it, and what each request size costs on it."""
    out = [f"box: {box.describe()}"]
    for verdict in verdicts:
        name = f"{verdict.profile.name}.toml"
        if verdict.fits:
            out.append(f"chosen: {name}: {verdict.profile.fast}")
            out += [f"  {line}" for line in (*verdict.notes, *profiles.costs(verdict))]
            unused = len(box.gpus) - profiles.gpus_named(verdict.config) if verdict.config else 0
            if unused > 0:
                out.append(f"  {unused} GPU(s) of the box unused: no shipped layout places a stage on them")
        else:
            out.append(f"not {name}: " + "; ".join(verdict.why_not))
    if not verdicts[-1].fits and not box.gpus:
        out.append(f"without a GPU only the tiny random model runs ({TINY}): `h3serve demo --config {TINY}`")
        out.append("  (`make demo`) tries the API and every service end to end; random weights make noise, not video")
    if not verdicts[-1].fits:
        out.append("no shipped profile fits this box")
    return out


def deployment(verdict: profiles.Verdict, lines: list[str]) -> str:
    header = [f"# Written by `h3serve init` from docs/deploy/{verdict.profile.name}.toml for this box:"]
    return "\n".join([*header, *(f"#   {line}" for line in lines), "", verdict.text])


def _run(args) -> None:
    try:
        box = boxes.read_file(args.box) if args.box else boxes.read_machine(Path(args.out).parent)
    except (boxes.BoxError, OSError) as exc:
        raise SystemExit(f"h3serve init: {exc}") from None
    verdicts = profiles.choose(box, Path(args.profiles), args.model_dir, args.transformer_file)
    lines = report(box, verdicts)
    print("\n".join(lines), flush=True)
    if not verdicts[-1].fits:
        raise SystemExit(REFUSED)
    chosen = verdicts[-1].config
    if not args.model_dir and chosen is not None:
        print(f"[model] dir is the profile's {chosen.gateway.model_dir!r}: --model-dir sets yours", flush=True)
    text = deployment(verdicts[-1], lines)
    if args.dry_run:
        print(f"\n--dry-run: not written to {args.out}:\n\n{text}", end="")
        return
    out = Path(args.out)
    if out.exists() and not args.force:
        raise SystemExit(f"h3serve init: {out} exists: --force overwrites it, --out writes elsewhere")
    out.write_text(text)
    print(f"wrote {out}: check it with `h3serve plan --config {out}`, start it with `h3serve up --config {out}`")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("init", help="write the fastest shipped deployment that fits this box")
    p.add_argument("--box", help="a box description (JSON or TOML: gpus, host_gib, disk_gib) instead of this machine")
    p.add_argument("--out", default="deploy.toml", help="the deployment file to write (default: deploy.toml)")
    p.add_argument("--model-dir", default="", help="[model] dir of the written deployment (default: the profile's)")
    p.add_argument("--transformer-file", default="", help="your GGUF of the transformer (single-24gb-gguf.toml)")
    p.add_argument(
        "--profiles",
        default=str(profiles.shipped_directory()),
        help="the directory of the shipped profiles (default: docs/deploy of this checkout)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the deployment instead of writing it")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.set_defaults(run=_run)
