"""The weights' loading bars `serve` draws on a terminal: what one line says, when it is
drawn and cleared, and that nothing is drawn when stderr is not a terminal."""

from __future__ import annotations

import io

from splitserve.load_bars import LoadBars, render


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_line_shows_each_workers_bar_and_share() -> None:
    line = render({"prefill-0": (68, 272), "decode-0": (272, 272)}, 200)
    assert line == (
        "loading weights: prefill-0 [=====               ]  25%  "
        "decode-0 [====================] 100%"
    )
    assert render({"decode-0": (0, 0)}, 200).endswith("[                    ]   0%")
    assert len(render({"prefill-0": (1, 2), "decode-0": (1, 2)}, 40)) == 40


def test_bars_are_redrawn_in_place_only_when_they_change_and_cleared_when_done() -> None:
    out = Terminal()
    bars = LoadBars(out, columns=200)
    bars.update("decode-0", 1, 4)
    bars.update("decode-0", 1, 4)  # no change: not redrawn
    bars.update("prefill-0", 4, 4)
    frames = out.getvalue().split("\r\x1b[K")[1:]
    assert frames == [
        "loading weights: decode-0 [=====               ]  25%",
        "loading weights: decode-0 [=====               ]  25%  "
        "prefill-0 [====================] 100%",
    ]
    bars.finish("prefill-0")
    assert out.getvalue().endswith("\r\x1b[K")  # an empty line for the log's next line
    bars.finish("never-started")  # nothing drawn for it: nothing written
    assert out.getvalue().count("\r\x1b[K") == 3


def test_nothing_is_drawn_where_stderr_is_not_a_terminal() -> None:
    out = io.StringIO()
    bars = LoadBars(out)
    bars.update("decode-0", 1, 4)
    bars.finish("decode-0")
    assert out.getvalue() == ""
