"""router/token_count.py's chunks: cut only where a byte-level BPE pre-token starts, so that
the chunks' token counts add up to the whole text's (tests/integration/test_token_count.py
checks the counts on the bundled tokenizer)."""

from __future__ import annotations

import random

import pytest

from router.token_count import chunks


def _text(seed: int) -> str:
    rng = random.Random(seed)
    alphabet = "abcXYZ019.,'!é中 \n\t"
    return "".join(rng.choice(alphabet) for _ in range(20_000))


@pytest.mark.parametrize("seed", range(5))
def test_chunks_add_up_to_the_text_and_each_cut_is_a_space_after_a_non_space(seed: int) -> None:
    text = _text(seed)
    pieces = list(chunks(text, size=512))
    assert "".join(pieces) == text
    assert len(pieces) > 1
    for piece in pieces[1:]:
        assert piece[0] == " "
    for piece in pieces[:-1]:
        assert not piece[-1].isspace()


def test_a_chunk_runs_on_to_the_next_cut_when_it_has_none() -> None:
    text = "x" * 1000 + " tail" + "y" * 100
    assert list(chunks(text, size=100)) == ["x" * 1000, " tail" + "y" * 100]


def test_a_text_without_any_cut_is_one_chunk() -> None:
    assert list(chunks("x" * 5000, size=100)) == ["x" * 5000]
    assert list(chunks(" " * 5000, size=100)) == [" " * 5000]  # no non-space before a space


def test_a_short_text_is_one_chunk() -> None:
    assert list(chunks("hello world", size=100)) == ["hello world"]
