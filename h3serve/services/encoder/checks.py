"""What the encoder checks of a request before it encodes anything: the ids, the media spec, and the prompt in
characters and in tokens (the text encoder's time grows with its tokens, and a 4-byte character is up to 4)."""

from __future__ import annotations

import copy
import threading

from h3serve.common.bounds import check_id
from h3serve.common.config import EncoderConfig
from h3serve.model import rules
from h3serve.model.rules import InvalidRequest
from h3serve.runtime.checks import check_media_spec
from h3serve.v1 import encoder_pb2, media_pb2


class TokenCounter:
    """Counts a prompt's tokens as the text-encoder block tokenizes it, on a copy of the tokenizer of its own: a
    fast tokenizer is not safe to call from two threads, and the model's copy is busy in the runs."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = copy.deepcopy(tokenizer)
        self._lock = threading.Lock()

    def __call__(self, text: str) -> int:
        with self._lock:
            return len(self._tokenizer(text, add_special_tokens=False)["input_ids"])


def check_prompt(prompt: str, config: EncoderConfig, tokens: TokenCounter) -> None:
    problem = rules.prompt_problem(prompt, config.max_prompt_chars) or rules.prompt_tokens_problem(
        tokens(prompt), config.max_prompt_tokens
    )  # characters first: they bound this
    if problem:
        raise InvalidRequest("prompt", problem)


def check_encode(request: encoder_pb2.EncodeRequest, config: EncoderConfig, tokens: TokenCounter) -> None:
    check_id("job_id", request.job_id)
    check_prompt(request.prompt, config, tokens)


def check_media(spec: media_pb2.MediaSpec, config: EncoderConfig, tokens: TokenCounter) -> None:
    check_media_spec(spec, config.geometry, config.max_input_bytes)
    check_prompt(spec.prompt, config, tokens)
