"""TextStream, on every backend (a GGUF file's too: SmolLM2's): the pieces it hands out add
up exactly to what the generated tokens add to the prompt's text (decode(prompt + new) minus
decode(prompt)), and no piece ends inside a character, whatever the tokens (random ids
produce broken UTF-8)."""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SMOLLM2, TOKENIZER
from tokenizer import TextStream, Tokenizer


@pytest.fixture(scope="module")
def backends(llama3):
    meta = llama3["meta_untied"][1]
    return {"sentencepiece": Tokenizer(TOKENIZER), "tiktoken": Tokenizer(os.path.join(meta["meta:2"], "tokenizer.model")),
            "hf": Tokenizer(meta["hf"]), "gguf": Tokenizer(SMOLLM2)}


def pieces_of(tok, prompt: list[int], new: list[int]) -> list[str]:
    stream = TextStream(tok, prompt)
    return [stream.add(t) for t in new] + [stream.flush()]


@pytest.mark.parametrize("name", ["sentencepiece", "tiktoken", "hf", "gguf"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_pieces_add_up_to_the_continuation(backends, name, data):
    tok = backends[name]
    ids = st.integers(0, tok.n_words - 1)
    text = data.draw(st.text(max_size=30))
    prompt = tok.encode(text, bos=True, eos=False) + data.draw(st.lists(ids, max_size=3))
    new = data.draw(st.lists(ids, max_size=40))
    pieces = pieces_of(tok, prompt, new)
    assert "".join(pieces) == tok.decode(prompt + new)[len(tok.decode(prompt)):]
    assert not any(p.endswith("\ufffd") for p in pieces[:-1])


@pytest.mark.parametrize("name", ["sentencepiece", "tiktoken", "hf", "gguf"])
def test_pieces_of_text_are_whole_characters(backends, name):
    tok = backends[name]
    text = " Größe 日本語 😀🦙 and  two  spaces\nnew line"
    prompt = tok.encode("Say:", bos=True, eos=False)
    new = tok.encode(text, bos=False, eos=False)
    pieces = pieces_of(tok, prompt, new)
    assert "".join(pieces) == tok.decode(prompt + new)[len(tok.decode(prompt)):]
    assert not any("\ufffd" in p for p in pieces)
