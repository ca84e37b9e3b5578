"""Counting an input's tokens only as far as the context: a text that cannot fit is known
after tokenizing about a context's worth of it, not all of it.

The text is tokenized in chunks of about CHUNK_CHARS characters, each cut just before a
space that follows a non-space, and the count stops once it reaches the limit. For a
byte-level BPE tokenizer (GPT-2's, the bundled SmolLM2's, Llama 3's: a ByteLevel
pre-tokenizer, no normalizer) such a cut is always a boundary between two pre-tokens,
and BPE never merges across one, so the chunks' counts add up to exactly the whole
text's. Other tokenizers are counted whole. A text with no such cut within a chunk runs
on to the next one; the router's character bound (router/request.py) caps that.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from cluster.engine.model.tokenizer import Tokenizer

CHUNK_CHARS = 4096
_CUT = re.compile(r"(?<=\S) ")  # a space after a non-space: a pre-token starts there


def chunks_exact(tokenizer: Tokenizer) -> bool:
    """Whether cutting at a space after a non-space keeps the count exact."""
    backend = tokenizer.hf.backend_tokenizer
    return backend.normalizer is None and "ByteLevel(" in repr(backend.pre_tokenizer)


def chunks(text: str, size: int = CHUNK_CHARS) -> Iterator[str]:
    """`text` in pieces of about `size` characters, each cut at CUT (a piece without
    one runs on to the next)."""
    start = 0
    while len(text) - start > size:
        cut = _last_cut(text, start + 1, start + size)
        if cut is None:
            m = _CUT.search(text, start + size)
            if m is None:
                break
            cut = m.start()
        yield text[start:cut]
        start = cut
    yield text[start:]


def _last_cut(text: str, lo: int, hi: int) -> int | None:
    at = text.rfind(" ", lo, hi + 1)
    while at >= lo and text[at - 1].isspace():
        at = text.rfind(" ", lo, at)
    return at if at >= lo else None


def count_tokens(tokenizer: Tokenizer, text: str, limit: int, special_tokens: bool) -> int:
    """`text`'s tokens (with the special tokens the tokenizer adds, if `special_tokens`),
    or some number >= `limit` once the count has passed it."""
    backend = tokenizer.hf.backend_tokenizer
    count = backend.num_special_tokens_to_add(False) if special_tokens else 0
    pieces = chunks(text) if chunks_exact(tokenizer) else iter((text,))
    for piece in pieces:
        count += len(backend.encode(piece, add_special_tokens=False))
        if count >= limit:
            break
    return count
