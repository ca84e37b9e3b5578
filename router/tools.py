"""Tool calls on the OpenAI chat API: the request's `tools` and `tool_choice` as the chat
template and a grammar see them, and the reply as `tool_calls`.

- The model's template renders the tools; one that ignores them (the bundled SmolLM2's)
  gets them in a default tool prompt, a system message (`with_tool_prompt`), that teaches
  Hermes' format.
- `auto`: a parser chosen by the template (or --tool-call-parser) reads the calls out of
  the reply: Hermes/Qwen `<tool_call>{json}</tool_call>` blocks (the default prompt's too),
  or Llama 3's bare `{"name": ..., "parameters": ...}`. No parser fits: the request is
  refused.
- `required` / a named function: the reply is held by a JSON schema (cluster/engine/
  grammar.py) to a list of calls of the given tools, or to the named function's
  arguments, so it always parses (as vLLM does).
- `none`: the tools are rendered, the reply is text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from cluster.types import InvalidRequestError

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text

    def body(self) -> dict[str, Any]:
        return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


@dataclass(frozen=True)
class Tools:
    """A request's tools, checked, and what its tool_choice asks."""

    functions: dict[str, dict[str, Any]]  # name -> parameters (a JSON schema)
    choice: str  # "auto" | "none" | "required" | "named"
    named: str | None = None
    parallel: bool = True

    def schema(self) -> dict[str, Any] | None:
        """The reply's JSON schema when the choice forces calls, else None."""
        if self.choice == "named":
            assert self.named is not None
            return self.functions[self.named]
        if self.choice != "required":
            return None
        calls = [{"type": "object", "required": ["name", "parameters"],
                  "additionalProperties": False,
                  "properties": {"name": {"const": name}, "parameters": parameters}}
                 for name, parameters in self.functions.items()]  # fmt: skip
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return array

    def calls(self, text: str, parser: str | None) -> tuple[str | None, list[ToolCall]]:
        """The reply's remaining content and its calls."""
        if self.choice in ("named", "required"):
            try:  # held to the schema, it parses unless cut short (finish_reason length)
                value = json.loads(text)
            except json.JSONDecodeError:
                return text, []
            if self.choice == "named":  # the reply's own text, as it streams (CallStream)
                assert self.named is not None
                return None, [ToolCall(self.named, text)]
            return None, [ToolCall(c["name"], json.dumps(c["parameters"])) for c in value]
        if self.choice == "none" or parser is None:
            return text, []
        content, calls = (hermes if parser == "hermes" else llama3_json)(text)
        calls = [c for c in calls if c.name in self.functions]
        return content, calls if self.parallel else calls[:1]


def read_tools(tools: Any, choice: Any, parallel: Any) -> Tools | None:
    """The body's tools and tool_choice, checked; None when no tools are given."""
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls: must be true or false")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice: needs tools")
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("tools: must be a list of functions")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        f = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(f, dict):
            raise InvalidRequestError(
                f"tools[{i}]: must be {{'type': 'function', 'function': ...}}"
            )
        name, parameters = f.get("name"), f.get("parameters", {"type": "object"})
        if not isinstance(name, str) or not name or not isinstance(parameters, dict):
            raise InvalidRequestError(f"tools[{i}].function: needs a name and object parameters")
        functions[name] = parameters
    named = None
    if isinstance(choice, dict):
        named = (choice.get("function") or {}).get("name")
        if choice.get("type") != "function" or named not in functions:
            raise InvalidRequestError(
                f"tool_choice: names no given function: {json.dumps(choice)[:60]}"
            )
        kind = "named"
    elif choice in (None, "auto", "none", "required"):
        kind = choice or "auto"
    else:
        raise InvalidRequestError(
            f"tool_choice: auto, none, required or a function, got {choice!r}"
        )
    return Tools(functions, kind, named, parallel is not False)


TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def with_tool_prompt(messages: list[dict[str, Any]], tools: list[Any]) -> list[dict[str, Any]]:
    """The messages with the tools in the default tool prompt, for a chat template that
    does not render tools: after the system message's text, or as one of its own first
    (templates that take one system message, first, keep working)."""
    prompt = TOOL_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def parser_for(template: str | None) -> str | None:
    """The reply format a chat template teaches its model, if one we read; a template that
    does not render tools gets the default tool prompt, which teaches Hermes'."""
    if not template:
        return None
    if "tools" not in template:
        return "hermes"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "<|eom_id|>" in template:
        return "llama3_json"
    return None


def hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    calls = []
    for block in HERMES.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            calls.append(ToolCall(call["name"], json.dumps(call.get("arguments", {}))))
    content = HERMES.sub("", text).strip() if calls else text
    return content or None, calls


def llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    try:
        call = json.loads(text.strip().removeprefix("<|python_tag|>"))
    except json.JSONDecodeError:
        return text, []
    if isinstance(call, dict) and isinstance(call.get("name"), str):
        arguments = call.get("parameters", call.get("arguments", {}))
        return None, [ToolCall(call["name"], json.dumps(arguments))]
    return text, []


NAME = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')


@dataclass
class CallStream:
    """A forced reply's tool calls delta by delta, as vLLM streams them: each call's id and
    name first, then its arguments' JSON text as it comes. A named call's arguments are
    the reply itself; `required`'s list (`[{"name", "parameters"}, ...]`) gives a call's id
    and name when its `parameters` value opens, then that value's text (an element whose
    value opens before its name goes out whole when it closes)."""

    tools: Tools
    text: str = ""
    calls: int = 0  # calls whose id and name went out
    scanned: int = 0  # how far `text` is read for the list's elements
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    element: int = -1  # where the open element starts
    arguments: int = -1  # where the open element's arguments not yet sent start (-1: none)

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The `tool_calls` items of the chunk that carries `text`."""
        self.text += text
        if self.tools.choice == "named":
            assert self.tools.named is not None
            if self.calls:
                return [{"index": 0, "function": {"arguments": text}}] if text else []
            self.calls = 1
            call = ToolCall(self.tools.named, text).body()
            return [{"index": 0, **call}]
        return self._required()

    def _required(self) -> list[dict[str, Any]]:
        """The items the list's text since the last call gives: calls opened, their
        arguments' new text, and elements that closed before their arguments opened."""
        out: list[dict[str, Any]] = []
        for at in range(self.scanned, len(self.text)):
            ch = self.text[at]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2:
                    self.element = at
                elif self.depth == 3 and self.arguments < 0:
                    name = NAME.search(self.text, self.element, at)
                    if name is not None:  # the arguments open: the call's id and name go out
                        call = ToolCall(json.loads(name.group(1)), "").body()
                        out.append({"index": self.calls, **call})
                        self.arguments = at
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 2 and self.arguments >= 0:  # the arguments closed
                    out += self._arguments(at + 1)
                    self.arguments, self.calls, self.element = -1, self.calls + 1, -1
                elif self.depth == 1 and self.arguments < 0 and at > self.element >= 0:
                    value = json.loads(self.text[self.element : at + 1])
                    call = ToolCall(value["name"], json.dumps(value["parameters"])).body()
                    out.append({"index": self.calls, **call})
                    self.calls += 1
                if self.depth == 1:
                    self.element = -1
        self.scanned = len(self.text)
        if self.arguments >= 0:
            out += self._arguments(len(self.text))
        return out

    def _arguments(self, end: int) -> list[dict[str, Any]]:
        """The open call's arguments text up to `end` not yet sent, as one item."""
        piece, self.arguments = self.text[self.arguments : end], end
        return [{"index": self.calls, "function": {"arguments": piece}}] if piece else []


@dataclass
class HermesStream:
    """`tool_choice: auto` read by the Hermes parser delta by delta: text outside
    `<tool_call>` blocks goes out as content as it comes (a tag's possible start held back),
    each block as a call when it closes (one of the request's tools; the first alone
    without parallel calls)."""

    tools: Tools
    held: str = ""  # content that may begin a tag, or an open block's text
    in_block: bool = False
    calls: int = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """The content and the `tool_calls` items of the chunk that carries `text`."""
        text, self.held = self.held + text, ""
        content, calls = "", []
        while text:
            tag = "</tool_call>" if self.in_block else "<tool_call>"
            before, found, text = text.partition(tag)
            if not found and self.in_block:  # a block never closed is text, as hermes() reads it
                content += "<tool_call>" + before if final else ""
                self.held = "" if final else before
                break
            if not found:
                keep = 0 if final else tag_start(before, tag)
                content += before[: len(before) - keep]
                self.held = before[len(before) - keep :]
                break
            if self.in_block:
                calls += self._call(before)
            else:
                content += before
            self.in_block = not self.in_block
        return content, calls

    def _call(self, block: str) -> list[dict[str, Any]]:
        _, found = hermes(f"<tool_call>{block}</tool_call>")
        found = [c for c in found if c.name in self.tools.functions]
        if not found or (self.calls and not self.tools.parallel):
            return []
        self.calls += 1
        return [{"index": self.calls - 1, **found[0].body()}]


def tag_start(text: str, tag: str) -> int:
    """How many of the text's last characters could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
