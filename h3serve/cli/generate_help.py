"""What `h3serve generate --help` says about canvases, frame counts and durations. Built from h3serve/model/rules.py
when the parser is, so the help states the rules the gateway applies instead of a copy of their numbers."""

from __future__ import annotations

from h3serve.model import rules


def canvas(height: int | None = None, width: int | None = None) -> str:
    """--height / --width; `height` x `width` is the command's own default canvas, None the deployment's."""
    geometry = rules.Geometry()
    released = "x".join(map(str, geometry.default_canvas)) + " (height x width)"
    default = (
        f"{height}x{width} (height x width)"
        if height and width
        else f"the deployment's ({released} for the released model), or with --first-frame the keyframe's aspect "
        f"ratio at short edge {geometry.canvas_short_edge}"
    )
    return (
        f"canvas side in pixels; --height and --width go together: multiples of {rules.CANVAS_MULTIPLE}, "
        f"width/height within 1:{rules.MAX_ASPECT} to {rules.MAX_ASPECT}:1, height*width at most "
        f"{geometry.canvas_max_pixels:,} for the released model (a deployment's [model] canvas_max_pixels). "
        f"Default: {default}"
    )


def num_frames() -> str:
    valid, default = rules.VALID_NUM_FRAMES, rules.DEFAULT_NUM_FRAMES
    return (
        f"frames at {rules.FPS} fps: {rules.FRAMES_PER_CHUNK}n+{rules.LATENTS_PER_CHUNK} from {valid[0]} to "
        f"{valid[-1]} ({', '.join(map(str, valid))}); default {default} ({default / rules.FPS:.2f} s)"
    )


def seconds() -> str:
    shortest, longest = rules.MIN_SECONDS, rules.MAX_SECONDS_EXACT
    samples = (shortest, round((shortest + longest) / 2), longest)
    examples = ", ".join(f"{s:g} s: {rules.frames_for_seconds(s)}" for s in samples)
    return (
        f"duration instead of --num-frames, {shortest} to {longest:g} s: seconds x {rules.FPS} rounded to a "
        f"frame, then up to the next {rules.FRAMES_PER_CHUNK}n+{rules.LATENTS_PER_CHUNK} frames ({examples})"
    )
