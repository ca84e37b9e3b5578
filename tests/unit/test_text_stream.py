"""TextStream: text deltas that never split a character and never show a stop string."""

from __future__ import annotations

from cluster.engine.model.tokenizer import TextStream

# Token id -> the bytes it stands for, as a byte-level BPE vocabulary would have it.
PIECES: dict[int, bytes] = {
    0: b"<prompt>",
    1: b"Hel",
    2: b"lo",
    3: b" ST",
    4: b"OP",
    5: b" more",
    6: b"\xc3",  # first byte of "é"
    7: b"\xa9",  # second byte of "é"
    8: b"\xe2",  # the three bytes of "€"
    9: b"\x82",
    10: b"\xac",
    11: b"!",
    12: b"fooSTOPbar",
    13: b"xyz",
    14: b"ab",
    15: b"a",
    16: b"cdxb",
}


class FakeTokenizer:
    """Decodes like a real byte-level tokenizer: bytes joined, broken UTF-8 as U+FFFD."""

    def decode(self, ids: list[int]) -> str:
        return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def stream(stops: tuple[str, ...] = ()) -> TextStream:
    return TextStream(FakeTokenizer(), [0, 0], stops)  # type: ignore[arg-type]


def feed(ts: TextStream, ids: list[int]) -> list[str]:
    """Add tokens one at a time; the delta taken after each (final at a stop)."""
    deltas = []
    for token in ids:
        stopped = ts.add(token)
        deltas.append(ts.take(final=stopped))
        if stopped:
            break
    return deltas


def test_without_stops_each_token_text_is_emitted_at_once() -> None:
    ts = stream()
    assert feed(ts, [1, 2, 5, 11]) == ["Hel", "lo", " more", "!"]
    assert ts.text == "Hello more!"
    assert ts.take(final=True) == ""


def test_the_prompt_is_not_part_of_the_output() -> None:
    ts = stream()
    assert feed(ts, [1]) == ["Hel"]


def test_a_long_output_decodes_past_the_window() -> None:
    ts = stream()
    ids = [1, 2, 5, 6, 7, 11] * 5
    assert "".join(feed(ts, ids)) == "Hello moreé!" * 5


def test_a_character_split_across_tokens_waits_until_it_is_complete() -> None:
    ts = stream()
    assert ts.add(6) is False
    assert ts.take(final=False) == ""
    assert ts.add(7) is False
    assert ts.take(final=False) == "é"
    assert ts.text == "é"


def test_a_three_byte_character_over_three_tokens_is_emitted_once_whole() -> None:
    ts = stream()
    assert feed(ts, [1, 8, 9, 10, 11]) == ["Hel", "", "", "€", "!"]
    assert "\ufffd" not in ts.text


def test_a_stop_string_across_tokens_cuts_the_text_before_it() -> None:
    ts = stream(("STOP",))
    deltas = feed(ts, [1, 2, 3, 4, 5])
    assert deltas == ["", "He", "llo", " "]  # hold back 3 chars until the stop is ruled out
    assert ts.text == "Hello "
    assert ts.take(final=True) == ""
    assert "".join(deltas) == "Hello "


def test_a_stop_string_inside_one_token_cuts_it() -> None:
    ts = stream(("STOP",))
    assert ts.add(12) is True
    assert ts.take(final=True) == "foo"
    assert ts.text == "foo"


def test_nothing_past_a_stop_is_ever_taken() -> None:
    ts = stream(("STOP",))
    feed(ts, [1, 2, 3, 4])
    assert ts.take(final=False) == ""
    assert ts.take(final=True) == ""
    assert ts.emitted == len("Hello ")


def test_the_earliest_of_several_stops_wins() -> None:
    ts = stream(("b", "cd"))
    assert ts.add(15) is False
    assert ts.add(16) is True
    assert ts.text == "a"


def test_while_not_final_the_last_len_stop_minus_one_chars_are_held_back() -> None:
    ts = stream(("abc",))
    assert ts.add(13) is False
    assert ts.take(final=False) == "x"  # the last 2 chars are held, whatever they are
    assert ts.add(14) is False
    assert ts.take(final=False) == "yz"
    assert ts.text == "xyzab"
    assert ts.take(final=True) == "ab"  # the request ended for another reason: flush


def test_the_hold_is_set_by_the_longest_stop() -> None:
    ts = stream(("!", "STOP"))
    ts.add(1)
    assert ts.take(final=False) == ""  # "Hel": 3 chars, all held for "STOP"
    ts.add(2)
    assert ts.take(final=False) == "He"


def test_a_kept_stop_string_ends_the_text_and_what_follows_it_is_cut() -> None:
    kept = TextStream(FakeTokenizer(), [0, 0], ("STOP",), keep_stop=True)  # type: ignore[arg-type]
    assert "".join(feed(kept, [1, 12, 13])) == "HelfooSTOP"
    assert "".join(feed(stream(("STOP",)), [1, 12, 13])) == "Helfoo"
