"""What evaluation harnesses and everyday clients send, through the official openai client
and plain HTTP against the tests' TorchServe (TP=2), checked against the demo model in this
process (TP=1): top logprobs (completions with echo, chat), n with a seed, token-id prompts,
max_tokens 0 with echo, penalties / logit_bias / min_tokens / stop_token_ids, vLLM's
tokenizer routes, and the TTFT/TPOT histograms' buckets."""

import re
import time

import openai
import pytest
import requests
import torch
import torch.nn.functional as F

import chat_format
import generate as G

PROMPT = "The secret of a happy life is"
MESSAGES = [{"role": "user", "content": "What should I do on a rainy day?"}]
TOL = 1e-4


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/predictions/llama/1.0/v1", api_key=server.key, max_retries=0)


def log_softmax(llama, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab): the in-process model's log-probabilities of the token after each prefix."""
    logits = llama.runner(torch.tensor([ids]), 0, slot=0)[0]
    return F.log_softmax(logits.float(), dim=-1)


def check_top(top: dict, row: torch.Tensor, k: int, tok, chosen: int):
    """An OpenAI legacy top_logprobs dict: the k most probable tokens and the chosen one."""
    values, ids = row.topk(k)
    want = {}
    for i, v in zip(ids.tolist() + [chosen], values.tolist() + [row[chosen].item()]):
        want.setdefault(tok.token_str(i), v)
    assert top.keys() == want.keys()
    assert list(top.values()) == pytest.approx(list(want.values()), abs=TOL)


def test_completion_top_logprobs_with_echo(client, demo_llama):
    tok = demo_llama.tokenizer
    out = client.completions.create(model="llama", prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                    logprobs=5)
    choice = out.choices[0]
    lp = choice.logprobs
    prompt_ids = tok.encode(PROMPT, bos=True, eos=False)
    new_ids = G.generate(demo_llama, [prompt_ids], 6, temperature=0)[0][0]
    ids = prompt_ids + new_ids
    assert lp.tokens == [tok.token_str(i) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    rows = log_softmax(demo_llama, ids)
    diffs = []
    for i in range(1, len(ids)):
        diffs.append(abs(lp.token_logprobs[i] - rows[i - 1, ids[i]].item()))
        check_top(lp.top_logprobs[i], rows[i - 1], 5, tok, ids[i])
    print(f"completion logprobs: {len(diffs)} positions, max |server - in-process| = {max(diffs):.2e}")
    assert max(diffs) < TOL
    # text_offset: where each token's text starts in the text returned
    assert choice.text == PROMPT + tok.decode(ids)[len(tok.decode(prompt_ids)):]
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[1] == 0
    for i in range(2, len(ids)):
        assert choice.text[lp.text_offset[i]:].startswith(tok.token_str(ids[i])), i


def test_chat_top_logprobs(client, demo_llama):
    tok = demo_llama.tokenizer
    out = client.chat.completions.create(model="llama", messages=MESSAGES, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=4)
    prompt_ids = chat_format.encode_dialog(tok, MESSAGES)
    new_ids = G.generate(demo_llama, [prompt_ids], 6, temperature=0)[0][0]
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.token_str(i) for i in new_ids]
    rows = log_softmax(demo_llama, prompt_ids + new_ids)[len(prompt_ids) - 1:]
    diffs = []
    for c, i, row in zip(content, new_ids, rows):
        assert bytes(c.bytes) == tok.token_bytes(i)
        values, ids = row.topk(4)
        assert [t.token for t in c.top_logprobs] == [tok.token_str(j) for j in ids.tolist()]
        diffs += [abs(c.logprob - row[i].item())] + [abs(t.logprob - v) for t, v in zip(c.top_logprobs, values.tolist())]
    print(f"chat logprobs and top logprobs: {len(diffs)} values, max |server - in-process| = {max(diffs):.2e}")
    assert max(diffs) < TOL


def test_n_with_a_seed(client):
    def ask(**kw):
        return client.completions.create(model="llama", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=11, **kw)

    first = ask(n=3)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert len(set(texts)) == 3  # each choice its own sequence and its own draws
    assert [c.text for c in ask(n=3).choices] == texts  # reproducible
    assert ask().choices[0].text == texts[0]  # the first choice has the request's seed
    assert first.usage.prompt_tokens == ask().usage.prompt_tokens  # the prompt counted once
    chat = [client.chat.completions.create(model="llama", messages=MESSAGES, max_tokens=8, temperature=1.0, seed=4,
                                           n=2) for _ in range(2)]
    assert [c.message.content for c in chat[0].choices] == [c.message.content for c in chat[1].choices]
    # two prompts, n=2: prompt-major choices, the prompt tokens counted once each
    two = client.completions.create(model="llama", prompt=[PROMPT, "Once upon a time"], max_tokens=4,
                                    temperature=0, n=2)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text == two.choices[1].text != two.choices[2].text == two.choices[3].text
    one = client.completions.create(model="llama", prompt=[PROMPT, "Once upon a time"], max_tokens=4, temperature=0)
    assert two.usage.prompt_tokens == one.usage.prompt_tokens
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens


def test_token_id_prompts_answer_as_text(client, demo_llama):
    tok = demo_llama.tokenizer
    texts = [PROMPT, "Once upon a time"]
    ids = [tok.encode(t, bos=True, eos=False) for t in texts]
    by_text = client.completions.create(model="llama", prompt=texts, max_tokens=10, temperature=0)
    by_ids = client.completions.create(model="llama", prompt=ids, max_tokens=10, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert by_ids.usage == by_text.usage
    one = client.completions.create(model="llama", prompt=ids[0], max_tokens=10, temperature=0, echo=True)
    assert one.choices[0].text == tok.decode(ids[0]) + by_text.choices[0].text
    with pytest.raises(openai.BadRequestError, match="vocabulary has ids"):
        client.completions.create(model="llama", prompt=[1, 99999], max_tokens=2)


def test_max_tokens_zero_scores_the_prompt(client, demo_llama):
    tok = demo_llama.tokenizer
    out = client.completions.create(model="llama", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    ids = tok.encode(PROMPT, bos=True, eos=False)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and len(choice.logprobs.tokens) == len(ids)
    rows = log_softmax(demo_llama, ids)
    want = rows[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want, abs=TOL)


def test_stop_token_ends_and_is_in_the_logprobs(client, demo_llama):
    """A stop id ends the text before it; the completion's logprobs end with it, and usage
    counts it, as vLLM's do."""
    tok = demo_llama.tokenizer
    full = client.completions.create(model="llama", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0)
    ids = G.generate(demo_llama, [tok.encode(PROMPT, bos=True, eos=False)], 8, temperature=0)[0][0]
    stop = next(t for i, t in enumerate(ids) if i >= 2 and t not in ids[:i])
    cut = ids.index(stop)
    out = client.completions.create(model="llama", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                                    extra_body={"stop_token_ids": [stop]})
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and out.usage.completion_tokens == cut + 1
    assert choice.logprobs.tokens == [tok.token_str(t) for t in ids[:cut + 1]]
    assert choice.logprobs.token_logprobs == pytest.approx(full.choices[0].logprobs.token_logprobs[:cut + 1], abs=TOL)
    assert choice.logprobs.text_offset[-1] == len(choice.text)
    assert full.choices[0].text.startswith(choice.text) and len(choice.text) < len(full.choices[0].text)


OPTIONS = {"presence_penalty": 0.8, "frequency_penalty": 0.5, "repetition_penalty": 1.4, "min_tokens": 6}


def test_penalties_and_bias_equal_in_process(server, client, demo_llama):
    """Greedy answers with every new sampling option equal the in-process ones: TP=2 ranks
    apply them alike."""
    tok = demo_llama.tokenizer
    bias = {tok.encode("zebra", bos=False, eos=False)[0]: 4.0}
    plain = demo_llama.text_completion([PROMPT], 16, temperature=0)[0]["generation"]
    want = demo_llama.text_completion([PROMPT], 16, temperature=0, logit_bias=bias, **OPTIONS)[0]
    assert want["generation"] != plain
    native = server.generate({"prompt": PROMPT, "max_new_tokens": 16, "temperature": 0,
                              "logit_bias": {str(k): v for k, v in bias.items()}} | OPTIONS)
    assert native == want
    extra = {"logit_bias": {str(k): v for k, v in bias.items()}} | OPTIONS
    out = client.completions.create(model="llama", prompt=PROMPT, max_tokens=16, temperature=0, extra_body=extra)
    assert out.choices[0].text == want["generation"]
    chat_want = demo_llama.chat_completion([MESSAGES], 12, temperature=0, **OPTIONS)[0]
    chat = client.chat.completions.create(model="llama", messages=MESSAGES, max_tokens=12, temperature=0,
                                          presence_penalty=0.8, frequency_penalty=0.5,
                                          extra_body={"repetition_penalty": 1.4, "min_tokens": 6})
    assert chat.choices[0].message.content == chat_want["generation"]["content"]


def test_native_n_and_top_logprobs(server, demo_llama):
    answers = server.generate({"prompt": PROMPT, "n": 2, "max_new_tokens": 5, "temperature": 0, "logprobs": True,
                               "top_logprobs": 2})
    want = demo_llama.text_completion([PROMPT], 5, temperature=0, logprobs=True, top_logprobs=2)[0]
    assert len(answers) == 2 and answers[0]["generation"] == answers[1]["generation"] == want["generation"]
    assert [[t["token"] for t in top] for top in answers[0]["top_logprobs"]] == \
        [[t["token"] for t in top] for top in want["top_logprobs"]]
    for got, ref in zip(answers[0]["top_logprobs"], want["top_logprobs"]):
        assert [t["logprob"] for t in got] == pytest.approx([t["logprob"] for t in ref], abs=TOL)


# --- vLLM's tokenizer routes -----------------------------------------------------------

def test_tokenizer_routes(server, demo_llama):
    tok = demo_llama.tokenizer
    base = f"{server.url}/predictions/llama/1.0"
    headers = server.headers()
    info = requests.get(f"{base}/tokenizer_info", headers=headers, timeout=60)
    assert info.status_code == 200, info.text
    assert info.json() == {"tokenizer_class": "SentencePieceTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                           "pad_token": None, "model_max_length": 512}
    assert requests.post(f"{base}/tokenizer_info", headers=headers, timeout=60).json() == info.json()

    def post(route, body):
        r = requests.post(f"{base}/{route}", json=body, headers=headers, timeout=60)
        return r.status_code, r.json()

    ids = tok.encode(PROMPT, bos=True, eos=False)
    assert post("tokenize", {"prompt": PROMPT}) == (200, {"tokens": ids, "count": len(ids), "max_model_len": 512})
    assert post("tokenize", {"prompt": PROMPT, "add_special_tokens": False})[1]["tokens"] == ids[1:]
    assert post("tokenize", {"messages": MESSAGES})[1]["tokens"] == chat_format.encode_dialog(tok, MESSAGES)
    assert post("detokenize", {"tokens": ids}) == (200, {"prompt": tok.decode(ids)})
    status, error = post("detokenize", {"tokens": [5, -1]})
    assert status == 400 and error["error"]["param"] == "tokens"
    status, error = post("tokenize", {"text": "a"})
    assert status == 400 and "exactly one of prompt or messages" in error["error"]["message"]


# --- metrics ---------------------------------------------------------------------------

def buckets(text: str, name: str) -> dict[str, float]:
    return {le: float(v) for le, v in re.findall(rf'^{name}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} (\S+)$', text, re.M)}


def histogram_totals(text: str, name: str) -> tuple[float, float]:
    """(_count, _sum) of a histogram of the metrics text (0, 0 before its first value)."""
    found = [float(re.search(rf'^{name}{part}{{[^}}]*}} (\S+)$', text, re.M).group(1))
             if re.search(rf'^{name}{part}{{', text, re.M) else 0.0 for part in ("_count", "_sum")]
    return found[0], found[1]


def test_latency_histograms_are_in_seconds(server, client):
    """TTFT and TPOT are in seconds, so that they land in TorchServe's (Prometheus' default)
    buckets of 5 ms to 10 s, not all in +Inf: three requests add three values each (every
    one has more than one token), which sum to no more than the seconds the client waited
    (milliseconds would be a thousand times more), and the buckets have their +Inf count."""
    before = requests.get(server.metrics_url, timeout=30).text
    start = time.perf_counter()
    for _ in range(3):
        done = client.completions.create(model="llama", prompt=PROMPT, max_tokens=5, temperature=0)
        assert done.usage.completion_tokens > 1
    waited = time.perf_counter() - start
    names = ("TimeToFirstToken", "TimePerOutputToken")
    deadline = time.time() + 30
    # the worker writes its metrics to its log, which the frontend reads on a thread of its
    # own: the last request's may reach /metrics after its answer (seen: 2 of 3)
    while True:
        text = requests.get(server.metrics_url, timeout=30).text
        if time.time() > deadline or all(histogram_totals(text, n)[0] >= histogram_totals(before, n)[0] + 3
                                          for n in names):
            break
        time.sleep(0.1)
    for name in names:
        (count0, sum0), (count1, sum1) = histogram_totals(before, name), histogram_totals(text, name)
        assert count1 - count0 == 3 and 0 < sum1 - sum0 <= waited, (name, count1 - count0, sum1 - sum0, waited)
        counts = buckets(text, name)
        assert counts and counts["+Inf"] == count1, counts
