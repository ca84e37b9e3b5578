"""Chat prompts are tokenized as transformers' `apply_chat_template(tokenize=True)` does:
a template that writes its own BOS (Llama 3's) gets one BOS, not two."""

from __future__ import annotations

import copy

from tokenizers.processors import TemplateProcessing

from cluster.engine.model.model_files import bundled_model_path
from cluster.engine.model.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def _reference(tok: Tokenizer) -> list[int]:
    ids = tok.hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_the_bundled_template_tokenizes_as_transformers_does() -> None:
    tok = Tokenizer.load(bundled_model_path())
    assert tok.encode_chat(MESSAGES) == _reference(tok)


def test_a_template_that_writes_bos_gets_exactly_one() -> None:
    hf = copy.deepcopy(Tokenizer.load(bundled_model_path()).hf)
    bos, bos_id = "<|endoftext|>", 0
    # A tokenizer that adds BOS to everything it encodes, as Llama 3's does...
    hf._tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, bos_id)]
    )
    # ...and a template that writes BOS itself, as Llama 3's does.
    hf.chat_template = (
        "{{ '" + bos + "' }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    tok = Tokenizer(hf)
    ids = tok.encode_chat(MESSAGES)
    assert ids == _reference(tok)
    assert ids[0] == bos_id and ids[1] != bos_id
    assert tok.encode(tok.apply_chat_template(MESSAGES))[:2] == [bos_id, bos_id]  # the old way
