"""How far apart two MP4s are once decoded: when their bytes differ, by how much the video and sound do.

A DiT group of N ranks computes the same request within float rounding of one rank (docs/deploy/
sharded-dit.md), so its MP4 need not be byte-identical to the in-process one; the lossy codecs then turn those
differences into a few levels of a pixel or a small audio sample difference, which this measures.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

import av
import numpy as np


def _video(path: Path):
    with av.open(str(path)) as container:
        for frame in container.decode(video=0):
            yield frame.to_ndarray(format="rgb24")


def _audio(path: Path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.concatenate([frame.to_ndarray() for frame in container.decode(audio=0)], axis=-1)


@dataclass(frozen=True)
class MediaDiff:
    video_levels: int  # largest difference of one decoded 8-bit pixel value (0: the same pictures)
    audio: float  # largest difference of one decoded audio sample (full scale is 1.0)

    @classmethod
    def of(cls, a: Path, b: Path) -> MediaDiff:
        """Frame by frame (a 768x1344x124 video is 384 MB decoded); different geometry is an error."""
        levels = 0
        for index, (x, y) in enumerate(zip_longest(_video(a), _video(b))):
            if x is None or y is None or x.shape != y.shape:
                raise ValueError(f"{a.name} and {b.name} differ in geometry at video frame {index}")
            levels = max(levels, int(np.abs(x.astype(np.int16) - y).max()))
        sound_a, sound_b = _audio(a), _audio(b)
        if sound_a.shape != sound_b.shape:
            raise ValueError(f"{a.name} and {b.name} differ in audio shape: {sound_a.shape} vs {sound_b.shape}")
        return cls(levels, float(np.abs(sound_a - sound_b).max()))

    def describe(self) -> str:
        return f"decoded video differs by at most {self.video_levels} levels, audio by {self.audio:.3g}"


@dataclass(frozen=True)
class FramesDiff:
    """How far apart two decodes are before any codec: float frames in [0, 1], their 8-bit levels (what the
    muxer encodes) and the waveform. Zero everywhere: the split computed exactly what the pipeline did."""

    frames: float  # largest difference of one float frame value
    levels: int  # largest difference of one 8-bit frame value after h3serve/services/vae/mux.to_uint8
    audio: float  # largest difference of one audio sample

    @classmethod
    def of(cls, a: Path, b: Path) -> FramesDiff:
        """`a`, `b`: .npz archives with `frames` (F, H, W, 3) and `audio` (channels, S), e.g. a raw.npz."""
        from h3serve.services.vae.mux import to_uint8

        with np.load(a) as x, np.load(b) as y:
            if x["frames"].shape != y["frames"].shape or x["audio"].shape != y["audio"].shape:
                raise ValueError(f"{a.name} and {b.name} differ in shape")
            frames = float(np.abs(x["frames"] - y["frames"]).max())
            levels = int(np.abs(to_uint8(x["frames"]).astype(np.int16) - to_uint8(y["frames"])).max())
            return cls(frames, levels, float(np.abs(x["audio"] - y["audio"]).max()))

    def describe(self) -> str:
        return (
            f"raw frames differ by at most {self.frames:.3g} ({self.levels} levels after uint8), "
            f"audio by {self.audio:.3g}"
        )


def main(argv: list[str] | None = None) -> None:
    """`python -m bench.media_diff REFERENCE.npz OTHER.npz`: how far OTHER's raw output is from REFERENCE's (two
    served runs' `served-*.npz`, say): the largest differences, and each part's relative L2 distance."""
    reference, other = map(Path, argv if argv is not None else sys.argv[1:])
    print(FramesDiff.of(other, reference).describe())
    with np.load(reference) as want, np.load(other) as got:
        for name in ("frames", "audio"):
            expected = want[name].astype(np.float64)
            difference = got[name].astype(np.float64) - expected
            print(
                f"{name} {got[name].shape}: relative L2 {np.linalg.norm(difference) / np.linalg.norm(expected):.3e}, "
                f"mean abs {np.abs(difference).mean():.3g}"
            )


if __name__ == "__main__":
    main()
