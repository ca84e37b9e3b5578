"""The openai backend counts a streamed chunk's tokens by its logprobs, as vLLM and
splitserve send them, and by its text when a server sends none."""

from __future__ import annotations

from typing import Any

import pytest

from splitserve.bench.serve_backend import _piece

LOGPROBS_CHAT = {"content": [{"token": "in", "logprob": -1.0}, {"token": "-", "logprob": -0.2}]}
LOGPROBS_TEXT = {"tokens": ["in", "-", "the"], "token_logprobs": [-1.0, -0.2, -1.4]}


@pytest.mark.parametrize(
    "choice, piece",
    [
        ({"index": 0, "text": "in-the", "logprobs": LOGPROBS_TEXT}, ("in-the", 3)),
        ({"index": 0, "delta": {"content": "in-"}, "logprobs": LOGPROBS_CHAT}, ("in-", 2)),
        # the role chunk that opens a chat stream carries no token
        ({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}, ("", 0)),
        # a token that completes no character yet: no text, still one token
        ({"index": 0, "text": "", "logprobs": {"tokens": ["\ufffd"]}}, ("", 1)),
        # no logprobs: one token per chunk with text
        ({"index": 0, "text": " word", "logprobs": None}, (" word", 1)),
        ({"index": 0, "delta": {}, "finish_reason": "length"}, ("", 0)),
    ],
)
def test_a_chunk_counts_its_tokens(choice: dict[str, Any], piece: tuple[str, int]) -> None:
    assert _piece(choice) == piece
