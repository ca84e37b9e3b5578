"""Chat prompts are tokenized as transformers' `apply_chat_template(tokenize=True)` does:
a template that writes its own BOS (Llama 3's) gets one BOS, not two. A request's
`add_special_tokens`, `add_generation_prompt` and template variables reach the tokens."""

from __future__ import annotations

import copy
import json

import pytest
from tokenizers.processors import TemplateProcessing

from cluster.engine.model.model_files import bundled_model_path
from cluster.engine.model.tokenizer import Tokenizer
from cluster.types import InvalidRequestError, ModelInfo
from router.request import prepare
from splitserve_api.v1 import splitserve_pb2 as pb

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def _reference(tok: Tokenizer) -> list[int]:
    ids = tok.hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_the_bundled_template_tokenizes_as_transformers_does() -> None:
    tok = Tokenizer.load(bundled_model_path())
    assert tok.encode_chat(MESSAGES) == _reference(tok)


BOS, BOS_ID = "<|endoftext|>", 0


def _bos_adding(template: str) -> Tokenizer:
    """The bundled tokenizer made to add BOS to everything it encodes, as Llama 3's does,
    with this chat template."""
    hf = copy.deepcopy(Tokenizer.load(bundled_model_path()).hf)
    hf._tokenizer.post_processor = TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, BOS_ID)]
    )
    hf.chat_template = template
    return Tokenizer(hf)


def test_a_template_that_writes_bos_gets_exactly_one() -> None:
    bos, bos_id = BOS, BOS_ID
    # ...and a template that writes BOS itself, as Llama 3's does.
    tok = _bos_adding(
        "{{ '" + bos + "' }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    ids = tok.encode_chat(MESSAGES)
    assert ids == _reference(tok)
    assert ids[0] == bos_id and ids[1] != bos_id
    assert tok.encode(tok.apply_chat_template(MESSAGES))[:2] == [bos_id, bos_id]  # the old way


THINKING = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and not "
    "enable_thinking %} <think></think>{% endif %}{% endif %}"
)
INFO = ModelInfo("m", max_model_len=256, vocab_size=49152, page_size=16)


def _ids(tok: Tokenizer, msg: pb.GenerateRequest) -> list[int]:
    return prepare(msg, tok, INFO, None).prompt_ids


def test_add_special_tokens_generation_prompt_and_template_variables_reach_the_tokens() -> None:
    tok = _bos_adding(THINKING)
    text = pb.GenerateRequest(text="Hello")
    assert _ids(tok, text)[0] == BOS_ID  # text: the tokenizer's own, by default
    text.add_special_tokens = False
    assert _ids(tok, text) == tok.encode("Hello", special_tokens=False)
    chat = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="Hi")]))
    plain = _ids(tok, chat)
    assert plain == tok.encode("user: Hi\nassistant:", special_tokens=False)  # chat: none
    chat.add_special_tokens = True
    assert _ids(tok, chat) == [BOS_ID, *plain]
    chat.ClearField("add_special_tokens")
    chat.chat.add_generation_prompt = False
    assert _ids(tok, chat) == tok.encode("user: Hi\n", special_tokens=False)
    chat.chat.ClearField("add_generation_prompt")
    chat.chat.template_kwargs = json.dumps({"enable_thinking": False})
    assert _ids(tok, chat) == tok.encode("user: Hi\nassistant: <think></think>", False)
    chat.chat.template_kwargs = json.dumps({"enable_thinking": False, "thinking_budget": 9})
    with pytest.raises(InvalidRequestError, match=(
        r"^chat.template_kwargs.thinking_budget: this model's chat template does not read "
        r"it \(it reads add_generation_prompt, enable_thinking, messages\)"
    )):  # fmt: skip
        _ids(tok, chat)
