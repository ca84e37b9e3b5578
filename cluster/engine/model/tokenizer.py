"""Tokenizer and chat template from the model files, plus incremental detokenization.

A GGUF file carries its BPE vocabulary, merges and chat template; transformers turns
them into a fast tokenizer once (seconds), which is then kept in a local cache.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from cluster.engine.model.model_files import ModelLoadError
from cluster.types import InvalidRequestError

log = logging.getLogger(__name__)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "splitserve" / "tokenizers"


class Tokenizer:
    def __init__(self, hf: Any) -> None:
        self.hf = hf

    @staticmethod
    def load(path: Path) -> Tokenizer:
        import transformers
        from transformers import AutoTokenizer

        if path.is_dir():
            if not (path / "tokenizer.json").is_file():
                raise ModelLoadError(f"{path}: tokenizer.json is missing")
            return Tokenizer(AutoTokenizer.from_pretrained(str(path)))
        stat = path.stat()
        key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
        cached = _cache_dir() / hashlib.sha256(key.encode()).hexdigest()[:16]
        if (cached / "tokenizer.json").is_file():
            return Tokenizer(AutoTokenizer.from_pretrained(str(cached)))
        log.info("converting the GGUF tokenizer of %s (once; cached in %s)", path.name, cached)
        try:
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception as e:  # transformers raises many kinds on a bad file
            raise ModelLoadError(f"{path}: cannot read the tokenizer: {e}") from None
        hf.save_pretrained(str(cached))
        return Tokenizer(hf)

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """`special_tokens`: with those the tokenizer adds around a text (a BOS)."""
        ids: list[int] = self.hf.encode(text, add_special_tokens=special_tokens)
        return ids

    def decode(self, ids: list[int]) -> str:
        text: str = self.hf.decode(ids, skip_special_tokens=True)
        return text

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[Any] | None = None,
        add_generation_prompt: bool = True,
        variables: dict[str, Any] | None = None,
    ) -> str:
        """Messages with roles (and tools, for a template that renders them: the router
        gives one that does not a default tool prompt instead), rendered by
        the model's own template, ready for the reply unless `add_generation_prompt` is
        false. `variables`: more for the template (`chat_template_kwargs`); one it does not
        read is refused by name, as a value it would ignore."""
        template = getattr(self.hf, "chat_template", None)
        if not template:
            raise ModelLoadError("this model has no chat template")
        unread = sorted(name for name in variables or {} if not self.reads(name))
        if unread:
            raise InvalidRequestError(
                f"chat.template_kwargs.{unread[0]}: this model's chat template does not read "
                f"it (it reads {', '.join(sorted(template_variables(template))) or 'nothing'})"
            )
        text: str = self.hf.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
            **(variables or {}),
        )  # fmt: skip
        return text

    def reads(self, name: str) -> bool:
        """Whether the chat template reads the variable `name`."""
        template = getattr(self.hf, "chat_template", None)
        return bool(template) and name in template_variables(template)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The rendered template's ids, no special tokens added: a template that writes its
        own BOS (Llama 3's) gets one, as transformers' `apply_chat_template` gives it."""
        return self.encode(self.apply_chat_template(messages), special_tokens=False)

    @property
    def eos_token_id(self) -> int | None:
        eos: int | None = self.hf.eos_token_id
        return eos


@functools.lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str]:
    """The variables a chat template reads (jinja2's undeclared ones), parsed as
    transformers compiles it (its extensions and globals)."""
    from jinja2 import meta
    from transformers.utils.chat_template_utils import _compile_jinja_template

    env = _compile_jinja_template(template).environment
    return frozenset(meta.find_undeclared_variables(env.parse(template))) - set(env.globals)


class TextStream:
    """Turns a growing list of token ids into text deltas, never splitting a character.

    Decodes a short window of recent tokens rather than the whole output each step,
    and holds back text that could still become a stop string.
    """

    WINDOW = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stops: tuple[str, ...],
        keep_stop: bool = False,  # the text ends with the stop string, not before it
    ) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-self.WINDOW :])
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""  # all output text so far (cut at a stop string)
        self.emitted = 0
        self.stops = stops
        self.keep_stop = keep_stop
        self.hold = max((len(s) for s in stops), default=1) - 1

    def add(self, token_id: int) -> bool:
        """Append one token; True when a stop string has appeared (text is cut before it,
        or after it when kept)."""
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return False  # an incomplete UTF-8 sequence: wait for the next token
        start = len(self.text)
        self.text += after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        found = [(self.text.find(s, max(0, start - len(s) + 1)), s) for s in self.stops]
        hits = [(at, s) for at, s in found if at != -1]
        if hits:
            at, stop = min(hits)
            self.text = self.text[: at + len(stop) if self.keep_stop else at]
        return bool(hits)

    def take(self, final: bool) -> str:
        """Text not yet emitted, minus what a stop string might still claim."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
