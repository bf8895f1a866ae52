"""MiniMax-H3's request rules without the model: frames and seconds, canvases, packed rows, audio, vision tokens.

diffusers' minimax_h3 pipeline states these as functions, block configs and properties of loaded
components. The gateway must apply them before anything runs (and without torch), the services and the
benchmarks must agree with it, so this module is the one place h3serve states them;
tests/test_model_rules.py pins each rule to diffusers' own functions over a grid of inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FPS = 24  # MiniMax-H3 generates and conditions at 24 fps
MIN_SECONDS, MAX_SECONDS = 5, 15
FRAMES_PER_CHUNK = 17  # the video VAE encodes clips of 17 frames ...
LATENTS_PER_CHUNK = 5  # ... keeping 5 latent frames each: frame counts are 17n+5, latent frames 5n+2
VAE_SPATIAL_RATIO = 16  # pixels per latent, each axis
PATCH = 2  # latents per transformer patch, each axis
CANVAS_MULTIPLE = VAE_SPATIAL_RATIO * PATCH
MAX_ASPECT = 4  # width / height within 1/4 .. 4
SAMPLE_RATE = 32000  # the audio VAE's rate
AUDIO_HOP = 800  # samples per audio latent: 40 latents per second
AUDIO_CHANNELS = 2  # stereo, packed channel-major as two blocks of audio rows
VIDEO_SAMPLE_FPS = 2.0  # the rate the text encoder reads a reference video at
VISION_MARKERS = 2  # <|vision_start|> and <|vision_end|> around every vision block

VALID_NUM_FRAMES = tuple(
    f for f in range(MIN_SECONDS * FPS, MAX_SECONDS * FPS + 1) if f % FRAMES_PER_CHUNK == LATENTS_PER_CHUNK
)
DEFAULT_NUM_FRAMES = VALID_NUM_FRAMES[0]  # 124: 5.17 s
MAX_SECONDS_EXACT = VALID_NUM_FRAMES[-1] / FPS  # 345 frames = 14.375 s: the next 17n+5 (362) is past 15 s
MIN_REFERENCE_FRAMES = FRAMES_PER_CHUNK + LATENTS_PER_CHUNK  # 22: the shortest clip the video VAE encodes
MIN_STEPS = 2  # sigma grid points: N gives N-1 denoise steps, so 1 would denoise nothing
# The modality tag of a packed row (diffusers' MINIMAX_H3_*_TAG). The text encoder tags its rows text, or video for
# the rows of a vision block; the DiT tags the generated and conditioning rows.
VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2
TEXT_ROW_TAGS = (VIDEO_TAG, TEXT_TAG)


class InvalidRequest(ValueError):
    """A request field breaks a rule; `message` starts with the field name and says what is allowed."""

    def __init__(self, field: str, detail: str):
        self.field = field
        self.message = f"{field}: {detail}"
        super().__init__(self.message)


# Frames, seconds, latents.


def align_num_frames(frames: int) -> int:
    """The next 17n+5 at or above `frames` (diffusers' align_num_frames)."""
    return frames + (LATENTS_PER_CHUNK - frames) % FRAMES_PER_CHUNK


def snap_down(frames: int) -> int:
    """The last 17n+5 at or below `frames`, n >= 1: what the video VAE keeps of a reference clip."""
    return max(1, (frames - LATENTS_PER_CHUNK) // FRAMES_PER_CHUNK) * FRAMES_PER_CHUNK + LATENTS_PER_CHUNK


def latent_frames(num_frames: int) -> int:
    """Latent frames of a 17n+5 frame count: 5n+2."""
    n, rest = divmod(num_frames - LATENTS_PER_CHUNK, FRAMES_PER_CHUNK)
    if rest or n < 0:
        raise ValueError(f"num_frames must be 17n+5, got {num_frames}")
    return n * LATENTS_PER_CHUNK + 2


def pixel_frames(num_latent_frames: int) -> int:
    """Frames the video VAE decodes 5n+2 latent frames into (n >= 1): 17n+5."""
    n, rest = divmod(num_latent_frames - 2, LATENTS_PER_CHUNK)
    if rest or n < 1:
        raise ValueError(f"latent frames must be 5n+2 with n >= 1, got {num_latent_frames}")
    return n * FRAMES_PER_CHUNK + LATENTS_PER_CHUNK


def frames_for_seconds(seconds: float) -> int | None:
    """The 17n+5 frame count a duration rounds up to (seconds x 24 rounded to a frame, then aligned); None below
    5 s or past 345 frames (14.375 s), the longest 17n+5 within the model's 15 s."""
    if not MIN_SECONDS <= seconds <= MAX_SECONDS:  # NaN fails too
        return None
    frames = align_num_frames(round(seconds * FPS))
    return frames if frames in VALID_NUM_FRAMES else None


def audio_latents(num_frames: int) -> int:
    """Audio latents per channel for a video of `num_frames`: round(F / 24 * 40); 124 -> 207, 345 -> 575."""
    return round(num_frames / FPS * SAMPLE_RATE / AUDIO_HOP)


def check_num_frames(num_frames: int) -> None:
    """A resolved frame count, as a stage receives it: InvalidRequest unless one of VALID_NUM_FRAMES."""
    if num_frames not in VALID_NUM_FRAMES:
        raise InvalidRequest(
            "num_frames", f"must be 17n+5 between {VALID_NUM_FRAMES[0]} and {VALID_NUM_FRAMES[-1]}, got {num_frames}"
        )


def check_steps(steps: int, max_steps: int) -> None:
    if not MIN_STEPS <= steps <= max_steps:
        raise InvalidRequest(
            "num_inference_steps",
            f"must be between {MIN_STEPS} and {max_steps} (sigma grid points: N gives N-1 denoise steps), got {steps}",
        )


# Canvases.


def aspect_ok(width: float, height: float) -> bool:
    return 0 < height <= MAX_ASPECT * width and width <= MAX_ASPECT * height


def check_resolved_canvas(height: int, width: int, geometry: Geometry) -> None:
    """A canvas as a stage receives it, resolved by the gateway: positive multiples of 32, and within one rounding
    step of a canvas that keeps the aspect and area rules. A requested canvas keeps them exactly; one that follows a
    keyframe's aspect ratio (`Geometry.canvas_for_aspect`) rounds each side to the nearest multiple of 32 afterwards,
    so it may pass them by up to half a multiple per side (768x1344's area budget by 3.6%)."""
    for field, value in (("height", height), ("width", width)):
        if value <= 0 or value % CANVAS_MULTIPLE:
            raise InvalidRequest(field, f"must be a positive multiple of {CANVAS_MULTIPLE}, got {value}")
    step = CANVAS_MULTIPLE // 2
    if width - step > MAX_ASPECT * (height + step) or height - step > MAX_ASPECT * (width + step):
        raise InvalidRequest(
            "width" if width > height else "height",
            f"aspect ratio width/height must be within 1:{MAX_ASPECT} and {MAX_ASPECT}:1, "
            f"got height {height}, width {width}",
        )
    if (height - step) * (width - step) > geometry.canvas_max_pixels:
        raise InvalidRequest(
            "height",
            f"height*width must be at most about {geometry.canvas_max_pixels:,} pixels "
            f"(canvas_max_pixels), got {height}*{width} = {height * width:,}",
        )


def largest_resolved_canvas_pixels(geometry: Geometry) -> int:
    """The largest area `check_resolved_canvas` accepts: what a stage's input buffers are sized for."""
    step, largest, height = CANVAS_MULTIPLE // 2, 0, CANVAS_MULTIPLE
    while True:
        widest = min(MAX_ASPECT * (height + step) + step, geometry.canvas_max_pixels // (height - step) + step)
        width = widest - widest % CANVAS_MULTIPLE
        if width < CANVAS_MULTIPLE or height - step > MAX_ASPECT * (width + step):
            return largest
        largest = max(largest, height * width)
        height += CANVAS_MULTIPLE


def rows_per_latent_frame(height: int, width: int) -> int:
    """Packed rows of one latent frame: one per 2x2 patch of the 16x-compressed canvas."""
    return (height // CANVAS_MULTIPLE) * (width // CANVAS_MULTIPLE)


@dataclass(frozen=True)
class Geometry:
    """MiniMax-H3's pipeline configs (diffusers' `ConfigSpec`s of the set-up blocks): the released values by default.

    A deployment may change them (`[model]` keys); the stages apply them to diffusers' blocks and the gateway
    resolves canvases and counts rows with the same numbers.
    """

    canvas_short_edge: int = 768
    canvas_max_pixels: int = 768 * 1344
    reference_image_short_edge: int = 2048

    def pipeline_configs(self) -> dict[str, int]:
        return {
            "canvas_short_edge": self.canvas_short_edge,
            "canvas_max_pixels": self.canvas_max_pixels,
            "reference_image_short_edge": self.reference_image_short_edge,
        }

    def canvas_for_aspect(self, aspect_width: float, aspect_height: float) -> tuple[int, int]:
        """(height, width) for an aspect ratio: short edge at `canvas_short_edge`, area capped at `canvas_max_pixels`,
        both axes rounded half to even to a multiple of 32 (diffusers' resolve_canvas_size, in its order of operations,
        so float rounding cannot tip a side to another multiple)."""
        if not aspect_ok(aspect_width, aspect_height):
            raise ValueError(
                f"aspect ratio must be within 1:{MAX_ASPECT} and {MAX_ASPECT}:1, got {aspect_width}:{aspect_height}"
            )
        ratio = aspect_width / aspect_height
        short = self.canvas_short_edge
        width, height = (short * ratio, float(short)) if ratio >= 1 else (float(short), short / ratio)
        area = width * height
        if area > self.canvas_max_pixels:
            scale = (self.canvas_max_pixels / area) ** 0.5
            width, height = width * scale, height * scale
        return _round_to_canvas(height), _round_to_canvas(width)

    @property
    def default_canvas(self) -> tuple[int, int]:
        """The canvas of a t2va / ref2va request that names none: 16:9."""
        return self.canvas_for_aspect(16, 9)

    def largest_reference_sides(self, image: bool) -> tuple[int, int]:
        """Bounds on the (short, long) sides of a reference's canvas: an image's short edge goes to
        `reference_image_short_edge`, a video's to `canvas_short_edge` at most (less when the area cap bites), each
        rounded to 32; the long side is within the aspect rule of the unrounded short edge."""
        short = self.reference_image_short_edge if image else self.canvas_short_edge
        return _round_to_canvas(short), _round_to_canvas(MAX_ASPECT * short)

    def image_reference_canvas(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) an image reference is encoded at: its short edge to `reference_image_short_edge`, rounded
        to 32, no area cap."""
        scale = self.reference_image_short_edge / min(width, height)
        return _round_to_canvas(height * scale), _round_to_canvas(width * scale)


def _round_to_canvas(side: float) -> int:
    return max(CANVAS_MULTIPLE, round(side / CANVAS_MULTIPLE) * CANVAS_MULTIPLE)


# References.


def reference_video_frames(num_frames: int, fps: float, generated_frames: int) -> int:
    """Frames of a video reference after the resample to 24 fps and the cut to the generated length."""
    frames = num_frames if fps == FPS else math.floor(num_frames * FPS / fps + 0.5)
    return min(frames, generated_frames)


def soundtrack_rows(samples: int, sample_rate: int, generated_frames: int) -> int:
    """Packed rows of a reference soundtrack: both channels, one row per 800 samples at 32 kHz of the part within
    the generated length."""
    kept = min(samples, int(generated_frames / FPS * sample_rate))
    if sample_rate != SAMPLE_RATE:
        kept = round(kept * SAMPLE_RATE / sample_rate)
    return AUDIO_CHANNELS * math.ceil(kept / AUDIO_HOP)


def max_soundtrack_rows(generated_frames: int) -> int:
    """The most packed rows a reference soundtrack takes in a video of `generated_frames`: a whole-length track at
    32 kHz, plus one latent per channel for the rounding of a resample to it."""
    return AUDIO_CHANNELS * (math.ceil(generated_frames / FPS * SAMPLE_RATE / AUDIO_HOP) + 1)


# The packed sequence.


@dataclass(frozen=True)
class Rows:
    """Rows of one request's packed DiT sequence, by kind."""

    text: int = 0  # the text encoder's output: prompt, labels, vision tokens
    condition_video: int = 0  # keyframe / reference latents
    condition_audio: int = 0  # reference soundtracks
    video: int = 0  # the generated video
    audio: int = 0  # the generated stereo audio

    @property
    def condition(self) -> int:
        return self.condition_video + self.condition_audio

    @property
    def total(self) -> int:
        return self.text + self.condition + self.video + self.audio


def generated_rows(height: int, width: int, num_frames: int) -> Rows:
    """The rows of the generated video and audio: latent frames x rows per frame, and 2 x audio latents."""
    return Rows(
        video=latent_frames(num_frames) * rows_per_latent_frame(height, width),
        audio=AUDIO_CHANNELS * audio_latents(num_frames),
    )


# Vision tokens of keyframes and references (Qwen3-VL's processors).


@dataclass(frozen=True)
class VisionGeometry:
    """What Qwen3-VL's processors need to size a vision block: patch, merge, temporal patch, pixel limits."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_min_pixels: int
    image_max_pixels: int
    video_min_pixels: int
    video_max_pixels: int
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @classmethod
    def from_processor_config(cls, config: dict) -> VisionGeometry:
        """From a saved `processor_config.json` (its image_processor and video_processor sections); keys it does not
        hold take the processors' class defaults (tests/test_model_rules.py compares with the loaded processor)."""
        image, video = config["image_processor"], config["video_processor"]
        if not (image.get("do_resize", True) and video.get("do_resize", True)):
            raise ValueError("text rows: processors with do_resize = False are not supported")
        return cls(
            image["patch_size"],
            image["merge_size"],
            video["temporal_patch_size"],
            image["size"]["shortest_edge"],
            image["size"]["longest_edge"],
            video["size"]["shortest_edge"],
            video["size"]["longest_edge"],
            bool(video.get("cap_pixels_per_frame", False)),
            video.get("max_video_tokens", 768),
        )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def image_tokens(self, height: int, width: int) -> int:
        """Pads of one image block: Qwen2-VL's image smart_resize, then (h/patch)(w/patch)/merge^2."""
        h, w, f = height, width, self.factor
        h_bar, w_bar = round(h / f) * f, round(w / f) * f
        if h_bar * w_bar > self.image_max_pixels:
            beta = math.sqrt(h * w / self.image_max_pixels)
            h_bar, w_bar = max(f, math.floor(h / beta / f) * f), max(f, math.floor(w / beta / f) * f)
        elif h_bar * w_bar < self.image_min_pixels:
            beta = math.sqrt(self.image_min_pixels / (h * w))
            h_bar, w_bar = math.ceil(h * beta / f) * f, math.ceil(w * beta / f) * f
        return self._tokens(h_bar, w_bar)

    def video_block_tokens(self, frames: int, height: int, width: int) -> int:
        """Pads of one block of a video of `frames` sampled frames: Qwen3-VL's video smart_resize."""
        f, t = self.factor, self.temporal_patch_size
        max_pixels = self.video_max_pixels
        if self.cap_pixels_per_frame:
            per_frame = max(
                min(self.max_video_tokens * f * f, self.video_max_pixels // frames), int(self.video_min_pixels * 1.05)
            )
            max_pixels = per_frame * frames
        if height < f or width < f:
            scale = max(f / height, f / width)
            height, width = int(height * scale), int(width * scale)
        h_bar, w_bar, t_bar = round(height / f) * f, round(width / f) * f, round(frames / t) * t
        if t_bar * h_bar * w_bar > max_pixels:
            beta = math.sqrt(frames * height * width / max_pixels)
            h_bar, w_bar = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
        elif t_bar * h_bar * w_bar < self.video_min_pixels:
            beta = math.sqrt(self.video_min_pixels / (frames * height * width))
            h_bar, w_bar = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return self._tokens(h_bar, w_bar)

    def _tokens(self, h_bar: int, w_bar: int) -> int:
        return (h_bar // self.patch_size) * (w_bar // self.patch_size) // self.merge_size**2


def sampled_frames(frames: int) -> int:
    """Frames the text encoder reads of a normalized 24 fps video: every 12th (2 fps), none twice."""
    indices: list[int] = []
    stride, cursor = FPS / VIDEO_SAMPLE_FPS, 0.0
    while round(cursor) < frames:
        if not indices or round(cursor) > indices[-1]:
            indices.append(round(cursor))
        cursor += stride
    return len(indices)


def video_block_timestamps(sampled: int, temporal_patch: int) -> list[float]:
    """The timestamp of every vision block: sampled frames merged in groups of `temporal_patch` (the last one
    repeated to fill a group), each block labelled with the mean of its first and last frame's time."""
    stamps = [index / VIDEO_SAMPLE_FPS for index in range(sampled)]
    stamps += [stamps[-1]] * (-len(stamps) % temporal_patch)
    return [(stamps[i] + stamps[i + temporal_patch - 1]) / 2 for i in range(0, len(stamps), temporal_patch)]


# The prompt.


def prompt_problem(prompt: str, max_chars: int) -> str | None:
    """Why a prompt cannot be encoded, or None. Used verbatim: no template, no truncation (the model's contract)."""
    if not prompt.strip():
        return "required and must not be blank"
    if len(prompt) > max_chars:
        return f"at most {max_chars} characters, got {len(prompt)}"
    return None


def prompt_tokens_problem(tokens: int, max_tokens: int) -> str | None:
    """Why a prompt of `tokens` tokens (counted with the model's tokenizer) is too long, or None: characters alone
    bound neither the text encoder's time nor its rows (one 4-byte character is up to 4 byte-level tokens)."""
    if tokens > max_tokens:
        return f"at most {max_tokens} tokens, got {tokens} (max_prompt_tokens)"
    return None
