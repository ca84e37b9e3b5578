"""A reasoning model's thoughts apart from its answer: `<think>...</think>` read out of the
reply as `reasoning_content`, the rest as `content` (vLLM's `--reasoning-parser`).

- `qwen3`: the reply reasons only when it opens with `<think>` (Qwen3 with thinking off
  gets an empty think block in its prompt and answers plainly); it ends at `</think>`.
- `deepseek_r1`: the reply starts reasoning (DeepSeek-R1's template opens `<think>` in the
  prompt; a `<think>` the model writes itself is dropped) and ends at `</think>`.

Structured output (a response format, a forced tool call) holds only the content: the
grammar starts after the `</think>` token (`grammar_bounds`), and under `qwen3` a reply
whose first token is not `<think>` is held from its first, as the split reads it.

A reply cut short inside its thoughts is all reasoning. The same machine splits a stream
delta by delta and a whole reply at once, so both give the same two texts: a tag split
across deltas is held back until it is whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.model.tokenizer import Tokenizer
from cluster.types import InvalidRequestError
from router.tools import tag_start

START, END = "<think>", "</think>"
# Each parser: whether a reply starts in its thoughts without writing `<think>`.
PARSERS = {"qwen3": False, "deepseek_r1": True}


@dataclass
class ReasoningSplit:
    """One reply's text, fed as it comes; each `feed` returns (reasoning, content) deltas."""

    starts_reasoning: bool
    state: str = "start"  # "start" (has it opened <think>?), "reasoning", "content"
    held: str = ""  # text that may still be part of a tag

    @staticmethod
    def of(parser: str) -> ReasoningSplit:
        return ReasoningSplit(PARSERS[parser])

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        reasoning = ""
        if self.state == "start":
            opened = text.lstrip()
            if opened.startswith(START):
                text, self.state = opened[len(START) :], "reasoning"
            elif START.startswith(opened) and not final:
                self.held = text  # perhaps the start of `<think>`
                return "", ""
            else:
                self.state = "reasoning" if self.starts_reasoning else "content"
        if self.state == "reasoning":
            before, end, after = text.partition(END)
            if end:
                reasoning, text, self.state = before, after, "content"
            else:
                keep = 0 if final else tag_start(text, END)
                reasoning, self.held = text[: len(text) - keep], text[len(text) - keep :]
                return reasoning, ""
        return reasoning, text

    def whole(self, text: str) -> tuple[str | None, str | None]:
        """A whole reply's reasoning and content, None for an empty one."""
        reasoning, content = self.feed(text, final=True)
        return reasoning or None, content or None


def grammar_bounds(parser: str, tokenizer: Tokenizer, field: str) -> tuple[int, int | None]:
    """The token ids a grammar held after the thoughts needs (Structured's reasoning_end
    and reasoning_start: `</think>`, and `<think>` where a reply may answer without
    thinking); InvalidRequestError naming `field` when the tokenizer does not have one of
    them as a single token (the engine reads tokens, not text)."""
    ids = []
    for tag in (END, START):
        found = tokenizer.encode(tag, special_tokens=False)
        if len(found) != 1:
            raise InvalidRequestError(
                f"{field}: structured output with the reasoning parser ({parser}) starts "
                f"after {END}, which this tokenizer does not have as one token"
            )
        ids.append(found[0])
    return ids[0], None if PARSERS[parser] else ids[1]
