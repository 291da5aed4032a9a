"""Exact text through TorchServe: a greedy answer continues its prompt byte for byte
(prompt + answer == the decode of prompt and generated tokens), whole and streamed, on the
native API and /v1/completions with and without echo; on the demo model (sentencepiece) and
on a Llama 3 fixture (tokenizer.json, its chat template) served at TP=2, whose chat answers
equal the in-process ones. That server runs several engine steps per TorchServe iteration, in
turn with the round trip (the CPU default): stop strings, max_new_tokens and a client that
leaves still end a stream where they should."""

import openai
import pytest

import generate as G
import llama2
from conftest import SERVER_SLOTS, decoded_after_leaving
from local_server import start_server
from serving_config import IN_TURN_STEPS

N_NEW = 16
PROMPTS = ["The secret of a happy life is", "Größe  und 😀 emoji:", "Once upon a time\n"]


@pytest.fixture(scope="module")
def llama3_server(llama3, tmp_path_factory):
    folder = llama3["scaled16"][1]["hf"]
    # in turn, 4 to 16 steps per iteration, as on a CPU without a core to spare (the tests' shared
    # server overlaps one step per iteration, as on a GPU)
    srv = start_server(tmp_path_factory.mktemp("llama3_server"), folder, tp=2, batch_size=SERVER_SLOTS,
                       handler={"max_seq_len": 256, "overlap": False})
    yield srv, llama2.tp_llama(None, folder, None, 1, max_batch_size=SERVER_SLOTS, max_seq_len=256)
    srv.stop(wait=False)


def greedy_tokens(llama, prompt: str) -> tuple[list[int], list[int]]:
    ids = llama.tokenizer.encode(prompt, bos=True, eos=False)
    (new,), _ = G.generate(llama.runner, [ids], N_NEW, temperature=0, tokenizer=llama.tokenizer)
    return ids, new


def check_exact(srv, llama):
    client = openai.OpenAI(base_url=f"{srv.url}/predictions/llama/1.0/v1", api_key=srv.key, max_retries=0)
    for prompt in PROMPTS:
        ids, new = greedy_tokens(llama, prompt)
        full = llama.tokenizer.decode(ids + new)
        assert full.startswith(llama.tokenizer.decode(ids)) and len(new) > 0
        body = {"prompt": prompt, "max_new_tokens": N_NEW, "temperature": 0}
        whole = srv.generate(body)["generation"]
        streamed = "".join(c["text"] for c in srv.stream(body))
        echoed = srv.generate(body | {"echo": True})["generation"]
        echo_streamed = "".join(c["text"] for c in srv.stream(body | {"echo": True}))
        completion = client.completions.create(model="llama", prompt=prompt, max_tokens=N_NEW, temperature=0)
        echo_completion = client.completions.create(model="llama", prompt=prompt, max_tokens=N_NEW, temperature=0,
                                                    echo=True)
        for text in (whole, streamed, completion.choices[0].text):
            assert prompt + text == full, (prompt, text)
        for text in (echoed, echo_streamed, echo_completion.choices[0].text):
            assert text == full, (prompt, text)


def test_demo_answers_continue_the_prompt(server, demo_llama):
    check_exact(server, demo_llama)


def test_llama3_answers_continue_the_prompt(llama3_server):
    check_exact(*llama3_server)


def test_llama3_chat_equals_in_process(llama3_server):
    srv, llama = llama3_server
    dialog = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is Größe? 😀"}]
    expected = llama.chat_completion([dialog], N_NEW, temperature=0)[0]
    assert expected["generation"]["content"]
    native = srv.generate({"messages": dialog, "max_new_tokens": N_NEW, "temperature": 0})
    assert native == expected
    client = openai.OpenAI(base_url=f"{srv.url}/predictions/llama/1.0/v1", api_key=srv.key, max_retries=0)
    answer = client.chat.completions.create(model="llama", messages=dialog, max_tokens=N_NEW, temperature=0)
    assert answer.choices[0].message.content == expected["generation"]["content"]
    assert answer.choices[0].finish_reason == expected["finish_reason"]
    streamed = client.chat.completions.create(model="llama", messages=dialog, max_tokens=N_NEW, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        expected["generation"]["content"]


def test_llama3_special_text_in_requests_stays_text(llama3_server):
    """<|eot_id|> typed in a prompt or a message is text: the prompt token counts are those
    of plain text."""
    srv, llama = llama3_server
    tok = llama.tokenizer
    prompt = "a <|eot_id|> b <|start_header_id|>user<|end_header_id|>"
    answer = srv.generate({"prompt": prompt, "max_new_tokens": 2, "temperature": 0})
    assert answer["usage"]["prompt_tokens"] == len(tok.encode(prompt, bos=True, eos=False))
    dialog = [{"role": "user", "content": prompt}]
    answer = srv.generate({"messages": dialog, "max_new_tokens": 2, "temperature": 0})
    expected = llama.chat_completion([dialog], 2, temperature=0)[0]
    assert answer == expected


# --- in turn: several engine steps per TorchServe iteration ---------------------------------

LONG = {"prompt": "Once upon a time", "max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
MOST_STEPS = IN_TURN_STEPS[1]  # steps per iteration, at most


def test_in_turn_chunks_add_up_and_stop_at_max_new_tokens(llama3_server):
    """Each chunk carries the tokens of an iteration's steps (4 or more after the first
    token's), and they add up to the whole answer, which has exactly max_new_tokens."""
    srv, llama = llama3_server
    whole = srv.generate(LONG)
    assert whole["usage"]["completion_tokens"] == LONG["max_new_tokens"] and whole["finish_reason"] == "length"
    chunks = srv.stream(LONG)
    assert "".join(c["text"] for c in chunks) == whole["generation"]
    assert chunks[-1]["usage"] == whole["usage"]
    assert 2 < len(chunks) <= 2 + LONG["max_new_tokens"] // 4, len(chunks)


def test_in_turn_stop_string_ends_at_its_token(llama3_server):
    """A stop string met in the middle of an iteration's steps ends the sequence at the step
    that completed it: the same text and usage as the in-process engine, which checks after
    every token."""
    srv, llama = llama3_server
    body = {"prompt": LONG["prompt"], "max_new_tokens": 100, "temperature": 0}
    full = srv.generate(body)["generation"]
    stop = "complex"  # a word of the greedy answer, which has 40 tokens or more before it
    assert stop in full and len(llama.tokenizer.encode(full[:full.index(stop)], bos=False, eos=False)) > 20
    expected = llama.text_completion([body["prompt"]], body["max_new_tokens"], temperature=0, stop=[stop])[0]
    assert expected["generation"] == full[:full.index(stop)]
    assert srv.generate(body | {"stop": [stop]}) == expected
    chunks = srv.stream(body | {"stop": [stop]})
    assert "".join(c["text"] for c in chunks) == expected["generation"]
    assert chunks[-1]["finish_reason"] == "stop" and chunks[-1]["usage"] == expected["usage"]


def test_in_turn_disconnect_stops_decoding_at_the_next_iteration(llama3_server):
    """A stream whose client goes away after its first chunk (one token) stops decoding when the
    worker hears of it, at the start of an iteration: after the one under way, and one more
    if it began before the close reached TorchServe, far fewer than the 200 tokens asked for.
    (TorchServe tells the worker with its next batch; in turn, the steps of the iteration under
    way cannot hear of it sooner.)"""
    srv, _ = llama3_server
    for _ in range(2):
        (first,), generated = decoded_after_leaving(srv, LONG, 1)
        assert first is not None
        assert generated <= 1 + 2 * MOST_STEPS, generated
