"""Protocol defects found by a suite written from vLLM's OpenAI tests (issue 30), checked in
this process: a body goes through openai_api.parse (or native_api.parse) and api.sequences
as the handler takes it; the answers are made of sequences finished as the engine leaves
them (a stop id that ended one is its stop_token, not in its tokens, with a logprob)."""

import json

import pytest

import api
import native_api
import openai_api
from api import Defaults, Limits, RequestError
from conftest import TOKENIZER
from sequence import Sequence
from tokenizer import Tokenizer

PROMPT = "The secret of a happy life is"
MESSAGES = [{"role": "user", "content": "What should I do on a rainy day?"}]
META = {"id": "cmpl-test", "created": 0, "model": "llama"}
LIMITS, DEFAULTS, MAX_SEQ_LEN = Limits(), Defaults(), 512


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(TOKENIZER)


def finished(route: str, body: dict, tokenizer, ends: list[int | None]) -> tuple[api.Request, list[Sequence]]:
    """The request of body and its n sequences, finished: the k-th with the first 12 tokens
    of a text and then ends[k], the stop id that ended it, or with 13 tokens and no stop id
    (max_tokens 13)."""
    req = openai_api.parse(route, body | {"max_tokens": 13}, "llama", LIMITS, DEFAULTS)
    text = tokenizer.encode("Once upon a time there was a little girl who lived in a village near the forest",
                            bos=False, eos=False)
    seqs = []
    for k, ((prompt, params), stop) in enumerate(zip(api.sequences(req, tokenizer, MAX_SEQ_LEN, LIMITS, DEFAULTS),
                                                     ends)):
        tokens = text[:12] if stop is not None else text[:13]
        seq = Sequence(prompt, params, k, None, tokens=tokens, stop_token=stop, text=tokenizer.decode(tokens),
                       finish_reason="length" if stop is None else "stop")
        if params.logprobs:  # one entry per sampled token, the stop id's included
            seq.logprobs = [-1.0] * len(seq.sampled)
            seq.top_logprobs = [[] for _ in seq.sampled]
            seq.text_offsets = openai_api.text_offsets(tokenizer, seq.sampled)
        seqs.append(seq)
    return req, seqs


def streamed_usage(events: str) -> dict:
    """The usage of a stream's last chunks (include_usage)."""
    chunks = [json.loads(e[len("data: "):]) for e in events.split("\n\n") if e and e != "data: [DONE]"]
    return next(c["usage"] for c in chunks if c.get("usage"))


STREAM = {"stream": True, "stream_options": {"include_usage": True}}


# --- usage counts every token a choice returns ---------------------------------------------

def test_completion_usage_counts_the_stop_ids_in_the_logprobs(tokenizer):
    """n=3, logprobs=0, temperature 1 (vLLM's test): two choices end on the EOS id, which their
    logprobs list; usage counts the 39 tokens listed, as vLLM's does, not the 37 of the text."""
    body = {"prompt": PROMPT, "n": 3, "logprobs": 0, "temperature": 1.0}
    eos = tokenizer.eos_id
    req, seqs = finished("completions", body, tokenizer, [eos, None, eos])
    out = openai_api.answer(req, seqs, tokenizer, META)
    assert [c["finish_reason"] for c in out["choices"]] == ["stop", "length", "stop"]
    assert [c["logprobs"]["tokens"][-1] for c in out["choices"]][::2] == [tokenizer.token_str(eos)] * 2
    listed = sum(len(c["logprobs"]["tokens"]) for c in out["choices"])
    assert listed == 39
    assert out["usage"]["completion_tokens"] == listed
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + listed


def test_completion_usage_is_the_same_without_logprobs_and_streamed(tokenizer):
    """Whether the logprobs are asked for or not, and in stream_options.include_usage's chunk."""
    eos = tokenizer.eos_id
    req, seqs = finished("completions", {"prompt": PROMPT, "n": 3, "logprobs": 0}, tokenizer, [eos, None, eos])
    usage = openai_api.answer(req, seqs, tokenizer, META)["usage"]
    assert usage["completion_tokens"] == 39
    req, seqs = finished("completions", {"prompt": PROMPT, "n": 3}, tokenizer, [eos, None, eos])
    assert openai_api.answer(req, seqs, tokenizer, META)["usage"] == usage
    req, seqs = finished("completions", {"prompt": PROMPT, "n": 3} | STREAM, tokenizer, [eos, None, eos])
    assert streamed_usage(openai_api.last_chunks(req, seqs, META, tokenizer)) == usage


def test_chat_usage_counts_the_tokens_of_its_logprobs(tokenizer):
    """A chat message's logprobs leave the stop id out (as OpenAI's do), and so does its usage,
    streamed or not."""
    eos = tokenizer.eos_id
    req, seqs = finished("chat", {"messages": MESSAGES, "n": 2, "logprobs": True}, tokenizer, [eos, None])
    out = openai_api.answer(req, seqs, tokenizer, META)
    assert out["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in out["choices"]) == 25
    req, seqs = finished("chat", {"messages": MESSAGES, "n": 2} | STREAM, tokenizer, [eos, None])
    assert streamed_usage(openai_api.last_chunks(req, seqs, META, tokenizer)) == out["usage"]


# --- a logit_bias error names every bad key and value ----------------------------------------

def refusals(body: dict, tokenizer) -> list[str]:
    """The messages of both APIs' refusals of body (parsed, then its sequences prepared)."""
    errors = []
    for parse in (lambda: native_api.parse(body, LIMITS, DEFAULTS),
                  lambda: openai_api.parse("completions", body, "llama", LIMITS, DEFAULTS)):
        with pytest.raises(RequestError) as e:
            api.sequences(parse(), tokenizer, MAX_SEQ_LEN, LIMITS, DEFAULTS)
        assert e.value.status == 400 and e.value.param == "logit_bias"
        errors.append(e.value.message)
    return errors


@pytest.mark.parametrize("bias,named", [
    ({"bad1": 50, "bad2": 20}, ["'bad1'", "'bad2'"]),
    ({"5": 500, "6": "x", "7": 1, "8": None}, ["'5'", "500", "'6'", "a string", "'8'", "null"]),
    ({"-1": 1, "9": True, "1.5": 2}, ["'-1'", "'9'", "a boolean", "'1.5'"]),
    ({"99999": 1, "5": 1, "88888": 2}, ["99999", "88888"]),
])
def test_logit_bias_error_names_every_bad_entry(tokenizer, bias, named):
    for message in refusals({"prompt": PROMPT, "logit_bias": bias}, tokenizer):
        missing = [word for word in named if word not in message]
        assert not missing, (missing, message)
