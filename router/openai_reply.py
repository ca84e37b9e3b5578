"""What the OpenAI front door answers, in OpenAI's shape: a whole reply's body, a
stream's chunks, logprobs, usage, and errors (`{"error": {"message", "type", "param",
"code"}}`, a refusal naming the field as OpenAI's body spells it).

A chat's reply comes apart into reasoning_content and content with a reasoning parser
(router/reasoning.py), and into tool calls (router/tools.py): read from the whole reply,
or fed chunk by chunk to a stream's split.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.engine.model.tokenizer import Tokenizer
from cluster.types import FinishReason, InvalidRequestError, PromptLogprob, TokenDelta, TopLogprobs
from router.openai_request import Call
from router.reasoning import ReasoningSplit
from router.router import Final
from router.tools import CallStream, HermesStream, ToolCall

FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


class HTTPError(Exception):
    """An error answered in OpenAI's shape with this status."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.kind}}  # fmt: skip


# The shared checks name fields as the gRPC API spells them; here, as OpenAI's body does.
OPENAI_NAMES = (("sampling.", ""), ("chat.messages", "messages"), ("token_ids", "prompt"),
                ("text", "prompt"), ("structured", "response_format"),
                ("chat.template_kwargs.reasoning_effort", "reasoning_effort"),
                ("chat.template_kwargs", "chat_template_kwargs"))  # fmt: skip


def invalid(e: InvalidRequestError) -> HTTPError:
    message = str(getattr(e, "cause", e))  # a worker's refusal arrives wrapped by Ray
    for ours, theirs in OPENAI_NAMES:
        if message.startswith(ours):
            message = theirs + message[len(ours) :]
            break
    field = message.split(":", 1)[0] if ":" in message else None
    return HTTPError(400, message, "invalid_request_error", field)


@dataclass
class Reply:
    """What a request's stream added up to."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # when asked for
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # when asked for
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None  # echo with logprobs
    finish: str | None = None
    final: Final | None = None


def usage(finals: dict[int, Final], n: int) -> dict[str, Any]:
    """Each prompt's tokens once (its choice 0's), every choice's completion; by index."""
    firsts = [f.usage for i, f in finals.items() if i % n == 0]
    prompt = sum(u.prompt_tokens for u in firsts)
    completion = sum(f.usage.completion_tokens for f in finals.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(u.cached_prompt_tokens for u in firsts)},
    }


def best(replies: list[Reply], best_of: int, n: int) -> list[Reply]:
    """Of each prompt's best_of candidates, the n whose tokens are likeliest together."""
    groups = [replies[k : k + best_of] for k in range(0, len(replies), best_of)]
    return [r for g in groups for r in sorted(g, key=lambda r: -sum(r.logprobs))[:n]]


@dataclass(frozen=True)
class Readers:
    """One streamed choice's readers: its thoughts' split, then its tool calls' parser."""

    thoughts: ReasoningSplit | None
    calls: CallStream | HermesStream | None


@dataclass(frozen=True)
class ReplyRenderer:
    """Our replies and deltas as OpenAI's JSON, for one served model."""

    tokenizer: Tokenizer  # tokens as text, in logprobs and an echoed prompt
    model: str  # the name each reply carries
    reasoning_parser: str | None  # router/reasoning.py's; None: no split
    tool_parser: str | None  # router/tools.py's; None: only forced calls are read

    def envelope(self, call: Call, rid: str) -> dict[str, Any]:
        kind = "chat.completion" if call.chat else "text_completion"
        return {"id": rid, "object": kind + (".chunk" if call.stream and call.chat else ""),
                "created": int(time.time()), "model": self.model}  # fmt: skip

    def _logprobs(
        self,
        call: Call,
        ids: list[int],
        values: list[float],
        tops: list[TopLogprobs],
        prompt: Sequence[PromptLogprob] | None = None,
    ) -> dict[str, Any]:
        """OpenAI's logprobs: each token's, with its alternatives when asked for."""
        tokens = [self.tokenizer.decode([t]) for t in ids]
        alternatives = [[(self.tokenizer.decode([t]), v) for t, v in top] for top in tops]
        if call.chat:
            content = [
                {"token": t, "logprob": v, "bytes": list(t.encode()),
                 "top_logprobs": [{"token": a, "logprob": w, "bytes": list(a.encode())}
                                  for a, w in (alternatives[i] if alternatives else [])]}
                for i, (t, v) in enumerate(zip(tokens, values, strict=True))
            ]  # fmt: skip
            return {"content": content}
        top: list[dict[str, float] | None] | None = (
            [dict(a) for a in alternatives] if alternatives else None
        )
        given: list[float | None] = list(values)
        if prompt:  # echo: the prompt's tokens first, the first of them with no logprob
            tokens = [self.tokenizer.decode([t]) for t, _, _ in prompt] + tokens
            given = [lp for _, lp, _ in prompt] + given
            if top is not None:
                first = [None if lp is None else {self.tokenizer.decode([t]): w for t, w in alt}
                         for _, lp, alt in prompt]  # fmt: skip
                top = first + top
        return {"tokens": tokens, "token_logprobs": given, "top_logprobs": top,
                "text_offset": None}  # fmt: skip

    def body(self, call: Call, replies: list[Reply]) -> dict[str, Any]:
        rid = ("chatcmpl-" if call.chat else "cmpl-") + uuid.uuid4().hex
        choices = []
        for i, reply in enumerate(replies):
            logprobs = None
            if call.logprobs:
                logprobs = self._logprobs(
                    call, reply.token_ids, reply.logprobs, reply.top_logprobs,
                    reply.prompt_logprobs,
                )  # fmt: skip
            choice: dict[str, Any] = {"index": i, "finish_reason": reply.finish,
                                      "logprobs": logprobs}  # fmt: skip
            if call.chat:
                reasoning, text = self._reasoning(reply.text)
                content, calls = self._tool_calls(call, text, reply.finish)
                choice["message"] = {"role": "assistant", "content": content}
                if self.reasoning_parser:  # either may be absent (None), as vLLM gives them
                    choice["message"].update(reasoning_content=reasoning, content=content or None)
                if calls:
                    choice["message"]["tool_calls"] = [c.body() for c in calls]
                    choice["finish_reason"] = "tool_calls"
            else:
                choice["text"] = self._echo(call, i) + reply.text
            choices.append(choice)
        body = {**self.envelope(call, rid), "choices": choices}
        finals = {i: r.final for i, r in enumerate(replies) if r.final is not None}
        if finals:
            body["usage"] = usage(finals, call.n)
        return body

    def _echo(self, call: Call, index: int) -> str:
        """The prompt choice `index` answers, as text, when the request asked for echo."""
        if not call.echo:
            return ""
        msg = call.requests[index // call.n]
        return msg.text if msg.HasField("text") else self.tokenizer.decode(list(msg.token_ids.ids))

    def _reasoning(self, text: str) -> tuple[str | None, str]:
        """A chat reply's thoughts (with a reasoning parser) and the rest."""
        if not self.reasoning_parser:
            return None, text
        reasoning, content = ReasoningSplit.of(self.reasoning_parser).whole(text)
        return reasoning, content or ""

    def _tool_calls(
        self, call: Call, text: str, finish: str | None
    ) -> tuple[str | None, list[ToolCall]]:
        if call.tools is None or finish != "stop":
            return text, []
        return call.tools.calls(text, self.tool_parser)

    def readers(self, call: Call) -> Readers:
        """A fresh choice's readers of its stream: its thoughts apart (a chat with a
        reasoning parser), then its tool calls as they come (streamable tools)."""
        parser, tools = self.reasoning_parser, call.tools
        split = ReasoningSplit.of(parser) if call.chat and parser else None
        calls: CallStream | HermesStream | None = None
        if tools is not None:
            calls = CallStream(tools) if tools.schema() is not None else HermesStream(tools)
        return Readers(split, calls)

    def chunk(self, call: Call, delta: TokenDelta, index: int, readers: Readers) -> dict[str, Any]:
        finish = None if delta.finish_reason is None else FINISH.get(delta.finish_reason)
        logprobs = None
        if call.logprobs:
            logprobs = self._logprobs(
                call, list(delta.token_ids), list(delta.logprobs), list(delta.top_logprobs),
                delta.prompt_logprobs,
            )  # fmt: skip
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        final, text, reasoning = delta.finish_reason is not None, delta.text, ""
        if readers.thoughts is not None:
            reasoning, text = readers.thoughts.feed(text, final=final)
        out: dict[str, Any] = {"reasoning_content": reasoning} if reasoning else {}
        calls = readers.calls
        if isinstance(calls, CallStream):
            items = calls.feed(text)
            choice["delta"] = {**out, "tool_calls": items} if items else out
            if finish == "stop" and calls.calls:
                choice["finish_reason"] = "tool_calls"
        elif isinstance(calls, HermesStream):
            content, items = calls.feed(text, final=final)
            choice["delta"] = out
            if content or not (items or finish or reasoning):
                choice["delta"]["content"] = content
            if items:
                choice["delta"]["tool_calls"] = items
            if finish == "stop" and calls.calls:
                choice["finish_reason"] = "tool_calls"
        elif readers.thoughts is not None:
            choice["delta"] = out
            if text or not (reasoning or finish):
                choice["delta"]["content"] = text
        elif call.chat:
            choice["delta"] = {"content": delta.text} if delta.text or not finish else {}
        else:
            choice["text"] = (self._echo(call, index) if delta.index == 0 else "") + delta.text
        return choice
