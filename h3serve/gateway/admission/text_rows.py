"""The exact text rows a request puts in the DiT's packed sequence, known at submit without running a model.

The text encoder's output rows are the tokens of MiniMax-H3's presentation (diffusers' minimax_h3 text
encoder steps): per keyframe (fl2va) or reference (ref2va), in packed order, a label ("<Picture i>: ",
"<Audio j>: ", "<Video k>: ") tokenized on its own and, for pictures and videos, vision blocks of
<|vision_start|> + pads + <|vision_end|>; then the prompt, tokenized verbatim. Which media a workflow
presents is the workflow's (h3serve/model/workflows); how many pads a vision block takes is Qwen3-VL's
processor rule (h3serve/model/rules.py). Tokens are counted with the deployment's own tokenizer: a byte
count is not a bound, since the tokenizer's NFC normalisation can lengthen text (U+0958 is 3 bytes, 6
after NFC). Everything here loads without torch: the tokenizer through transformers' tokenizers backend,
the processor's settings from its saved JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from h3serve.model import presets, rules, workflows
from h3serve.model.rules import VISION_MARKERS, Geometry, VisionGeometry
from h3serve.model.workflows.base import AssetLookup
from h3serve.v1 import gateway_pb2


@dataclass(frozen=True)
class TextCounter:
    """Counts text-encoder output rows with the deployment's tokenizer and processor settings."""

    count_tokens: Callable[[str], int]
    vision: VisionGeometry

    @classmethod
    def load(cls, model_dir: str) -> TextCounter:
        """The tokenizer and processor settings the encoder loads from `model_dir` ("" = the tiny preset, whose
        tokenizer and processor random:full uses too)."""
        from transformers import Qwen2Tokenizer

        if model_dir and model_dir != presets.RANDOM_FULL:
            tokenizer = Qwen2Tokenizer.from_pretrained(str(Path(model_dir) / "tokenizer"))
            config = json.loads((Path(model_dir) / "processor" / "processor_config.json").read_text())
        else:
            tokenizer, config = presets.tiny_tokenizer(), presets.tiny_processor_config()
        return cls(
            lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]),
            VisionGeometry.from_processor_config(config),
        )

    def tokens(self, text: str) -> int:
        return self.count_tokens(text)

    def picture(self, index: int, height: int, width: int) -> int:
        """The label "<Picture i>: " and the vision block of an image at its encoded size."""
        return self.tokens(f"<Picture {index}>: ") + VISION_MARKERS + self.vision.image_tokens(height, width)

    def video(self, index: int, frames: int, height: int, width: int) -> int:
        """The label "<Video k>: " and one timestamped vision block per temporal patch of `frames` sampled frames."""
        stamps = rules.video_block_timestamps(frames, self.vision.temporal_patch_size)
        per_block = VISION_MARKERS + self.vision.video_block_tokens(frames, height, width)
        return self.tokens(f"<Video {index}>: ") + sum(
            self.tokens(f"<{stamp:.1f} seconds>") + per_block for stamp in stamps
        )


@dataclass(frozen=True)
class TextRows:
    """A resolved request's text rows: its workflow presents the media, the counter sizes them."""

    counter: TextCounter
    geometry: Geometry = Geometry()

    @classmethod
    def load(cls, model_dir: str, geometry: Geometry) -> TextRows:
        return cls(TextCounter.load(model_dir), geometry)

    def __call__(self, request: gateway_pb2.ResolvedRequest, assets: AssetLookup) -> int:
        workflow = workflows.by_value(request.workflow)
        return workflow.text_rows(request, assets, self.counter, self.geometry)
