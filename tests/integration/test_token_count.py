"""router/token_count.py on the bundled tokenizer: counting a text in chunks gives exactly
the count of tokenizing it whole, for every kind of text a cut could split badly."""

from __future__ import annotations

import random
import string

import pytest

from cluster.engine.model.tokenizer import Tokenizer
from router.token_count import CHUNK_CHARS, chunks, chunks_exact, count_tokens


def _words(seed: int, alphabet: str, separators: list[str]) -> str:
    rng = random.Random(seed)
    words = ("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(4000))
    return "".join(w + rng.choice(separators) for w in words)


SPACES = [" ", "  ", "\n ", " \n", "\t "]
TEXTS = {
    "words": _words(0, string.ascii_letters, [" "]),
    "runs of spaces and newlines": _words(1, string.ascii_lowercase, SPACES),
    "punctuation and digits": _words(2, string.ascii_letters + string.digits + ".,'!?-", [" "]),
    "contractions": " ".join(["it's", "we're", "they'll", "I'd", "'tis"] * 1500),
    "unicode": _words(3, "éàüßжщ中文字日本語😀", [" ", "  "]),
    "no space at all": "x" * 20_000,
    "special tokens": " ".join(["<|im_start|>user hi<|im_end|>"] * 1500),
}


def test_the_bundled_tokenizer_is_counted_in_chunks(tok: Tokenizer) -> None:
    assert chunks_exact(tok)


@pytest.mark.parametrize("kind", list(TEXTS))
def test_chunked_counts_equal_the_whole_texts(tok: Tokenizer, kind: str) -> None:
    text = TEXTS[kind]
    assert len(text) > CHUNK_CHARS
    for special in (True, False):
        whole = len(tok.encode(text, special_tokens=special))
        assert count_tokens(tok, text, 10**9, special) == whole, (kind, special)
    if kind != "no space at all":
        assert len(list(chunks(text))) > 1


def test_a_rendered_chat_is_counted_like_encode_chat(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": TEXTS["words"]}, {"role": "assistant", "content": "ok"}]
    rendered = tok.apply_chat_template(messages)
    assert count_tokens(tok, rendered, 10**9, False) == len(tok.encode_chat(messages))
