"""`h3serve reference`: diffusers' own pipeline in this process on the same model, request and media as a served
clip, writing the same .npz as `generate --raw` (the pipeline itself: cli/reference.py, which loads torch)."""

from __future__ import annotations

import sys
from pathlib import Path

from h3serve.cli import generate_help
from h3serve.cli.request_flags import add_media_args, add_request_args, option_values, prompt
from h3serve.common.config import load_deploy
from h3serve.model import options, rules


def _run(args) -> None:
    import numpy as np
    import torch

    from h3serve.cli.reference import ReferenceRequest, resolved_params, run_reference, service_threads
    from h3serve.runtime import checkpoints
    from h3serve.runtime.models import ModelSource

    config = load_deploy(args.config)
    threads, note = service_threads(config)
    if note:
        print(f"reference: {note}", file=sys.stderr)
    if threads:
        torch.set_num_threads(threads)
    frames = {dest: path for dest, path in args.media if dest in ("first_frame", "last_frame")}
    refs = tuple((dest.removeprefix("ref_"), path) for dest, path in args.media if dest.startswith("ref_"))
    try:
        given = options.params(option_values(args))
        params = resolved_params(config.dit.adapters, given, config.gateway.default_steps)
    except ValueError as exc:
        raise SystemExit(f"h3serve reference: {exc}") from None
    source = ModelSource(args.model_dir or config.dit.model_dir or None, config.dit.transformer_file)  # the DiT's file
    try:
        result = run_reference(
            source,
            ReferenceRequest(prompt(args), args.height, args.width, args.num_frames, params, references=refs, **frames),
            args.device,
            args.dtype,
            config.gateway.geometry,
            config.dit.adapters,
        )
    except checkpoints.CheckpointRefused as exc:  # one line naming the file's own key, as `serve dit` says it
        raise SystemExit(f"h3serve reference: {exc}") from None
    # numpy's stub matches a ** dict against savez's allow_pickle keyword too; the result has no such key
    np.savez(args.raw, **result)  # type: ignore[arg-type]
    print(f"reference: {Path(args.raw).resolve()}")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("reference", help="run diffusers' in-process pipeline; writes the same .npz as --raw")
    p.add_argument(
        "--model-dir", help="diffusers model directory (default: --config's [model] dir, else the tiny preset)"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    add_request_args(
        p, steps=None, required=("seed",)
    )  # unset: an adapter's recommendation, else the deployment's default_steps
    p.add_argument("--num-frames", type=int, default=rules.DEFAULT_NUM_FRAMES, help=generate_help.num_frames())
    p.add_argument("--raw", required=True)
    p.add_argument(
        "--config",
        help="deployment TOML: its [model] dir and pipeline configs (geometry), and the "
        "model services' threads, so the bytes match the served ones",
    )
    add_media_args(p)
    p.set_defaults(run=_run)
