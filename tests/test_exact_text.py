"""Exact text through TorchServe: a greedy answer continues its prompt byte for byte
(prompt + answer == the decode of prompt and generated tokens), whole and streamed, on the
native API and /v1/completions with and without echo; on the demo model (sentencepiece) and
on a Llama 3 fixture (tokenizer.json, its chat template) served at TP=2, whose chat answers
equal the in-process ones."""

import openai
import pytest

import generate as G
import llama2
from conftest import SERVER_SLOTS
from local_server import start_server

N_NEW = 16
PROMPTS = ["The secret of a happy life is", "Größe  und 😀 emoji:", "Once upon a time\n"]


@pytest.fixture(scope="module")
def llama3_server(llama3, tmp_path_factory):
    folder = llama3["scaled16"][1]["hf"]
    srv = start_server(tmp_path_factory.mktemp("llama3_server"), folder, tp=2, batch_size=SERVER_SLOTS,
                       handler={"max_seq_len": 256})
    yield srv, llama2.tp_llama(None, folder, None, 1, max_batch_size=SERVER_SLOTS, max_seq_len=256)
    srv.stop()


def greedy_tokens(llama, prompt: str) -> tuple[list[int], list[int]]:
    ids = llama.tokenizer.encode(prompt, bos=True, eos=False)
    (new,), _ = G.generate(llama.model, [ids], N_NEW, temperature=0, tokenizer=llama.tokenizer)
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
