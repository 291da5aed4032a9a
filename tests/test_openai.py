"""The OpenAI-compatible routes, driven by the official openai client, and the generation
metrics on TorchServe's Prometheus endpoint."""

import re
import time

import openai
import pytest
import requests

PROMPT = "The secret of a happy life is"
MESSAGES = [{"role": "system", "content": "You are a cheerful assistant."},
            {"role": "user", "content": "What should I do on a rainy day?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/predictions/llama/1.0/v1", api_key=server.key, max_retries=0)


def with_stop_id(native: dict) -> int:
    """The completion tokens of OpenAI's completion of a native answer: OpenAI's count the stop
    id that ended the choice (as vLLM's do), the native API's do not (as Meta's reference);
    without stop strings, finish_reason "stop" means a stop id."""
    return native["usage"]["completion_tokens"] + (native["finish_reason"] == "stop")


def test_completions_equal_native(server, client):
    native = server.generate({"prompt": [PROMPT, "Once upon a time"], "temperature": 0, "max_new_tokens": 20})
    result = client.completions.create(model="llama", prompt=[PROMPT, "Once upon a time"], max_tokens=20,
                                       temperature=0)
    assert [c.text for c in result.choices] == [n["generation"] for n in native]
    assert [c.finish_reason for c in result.choices] == [n["finish_reason"] for n in native]
    assert [c.index for c in result.choices] == [0, 1]
    assert result.object == "text_completion" and result.model == "llama" and result.id.startswith("cmpl-")
    assert result.usage.prompt_tokens == sum(n["usage"]["prompt_tokens"] for n in native)
    assert result.usage.completion_tokens == sum(with_stop_id(n) for n in native)
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_chat_equals_native(server, client):
    native = server.generate({"dialog": MESSAGES, "temperature": 0, "max_new_tokens": 20})
    result = client.chat.completions.create(model="llama", messages=MESSAGES, max_tokens=20, temperature=0)
    choice = result.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == native["generation"]["content"]
    assert choice.finish_reason == native["finish_reason"]
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    assert result.usage.completion_tokens == native["usage"]["completion_tokens"]


def test_completion_streaming(server, client):
    native = server.generate({"prompt": PROMPT, "temperature": 0, "max_new_tokens": 20})
    chunks = list(client.completions.create(model="llama", prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks if c.choices) == native["generation"]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [native["finish_reason"]]
    assert chunks[-1].usage.completion_tokens == with_stop_id(native)


def test_chat_streaming(server, client):
    native = server.generate({"dialog": MESSAGES, "temperature": 0, "max_new_tokens": 20})
    chunks = list(client.chat.completions.create(model="llama", messages=MESSAGES, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == native["generation"]["content"]
    assert chunks[-1].choices[0].finish_reason == native["finish_reason"]
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_options_stop_seed_logprobs(server, client, demo_llama):
    full = client.completions.create(model="llama", prompt=PROMPT, max_tokens=20, temperature=0).choices[0].text
    stop = full.split()[2]
    cut = client.completions.create(model="llama", prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    sampled = [client.completions.create(model="llama", prompt=PROMPT, max_tokens=20, temperature=1.0, seed=5)
               .choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]
    scored = client.completions.create(model="llama", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0,
                                       echo=True)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text.startswith(PROMPT)
    assert len(lp.tokens) == len(lp.token_logprobs) == scored.usage.prompt_tokens + scored.usage.completion_tokens
    local = demo_llama.text_completion([PROMPT], 5, temperature=0, logprobs=True, echo=True)[0]["logprobs"]
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1:] == pytest.approx(local[1:], abs=1e-3)
    # vLLM's test: usage counts every token of the logprobs, the stop ids that ended choices included
    sampled = client.completions.create(model="llama", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=13,
                                        n=3, logprobs=0, logit_bias={str(demo_llama.tokenizer.eos_id): 4})
    assert any(c.finish_reason == "stop" for c in sampled.choices)  # a stop id ended one (no stop strings)
    assert sampled.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in sampled.choices)
    chat = client.chat.completions.create(model="llama", messages=MESSAGES, max_tokens=5, temperature=0,
                                          logprobs=True)
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens


def test_first_stream_event_comes_before_the_end(client):
    """Events go out as tokens are made, not all at the end of the request: one per
    iteration of (the tests' server: handler.steps_per_iteration 1) engine step, unless a
    token ends in the middle of a character (its text waits for the next one)."""
    start = time.perf_counter()
    arrivals = [time.perf_counter() - start for _ in client.completions.create(
        model="llama", prompt="A very long story:", max_tokens=64, temperature=0, stream=True)]
    assert len(arrivals) >= 64 * 3 / 4
    assert arrivals[0] < arrivals[-1] / 4, (arrivals[0], arrivals[-1])


def test_completion_logprobs_equal_native_and_in_process(server, client, demo_llama):
    """OpenAI's logprobs (with echo: the prompt's too, none for its first token) are the native
    API's and those of the model in this process, token for token."""
    native_body = {"prompt": PROMPT, "max_new_tokens": 8, "temperature": 0, "logprobs": True}
    for echo in (True, False):
        scored = client.completions.create(model="llama", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                                           echo=echo).choices[0]
        native = server.generate(native_body | {"echo": echo})
        local = demo_llama.text_completion([PROMPT], 8, temperature=0, logprobs=True, echo=echo)[0]
        lp = scored.logprobs
        assert lp.tokens == native["tokens"] == local["tokens"]
        assert scored.text == native["generation"] == local["generation"]
        values = lp.token_logprobs
        if echo:
            assert values[0] is None and native["logprobs"][0] == 0.0  # nothing predicts the first token
            values, native["logprobs"], local["logprobs"] = values[1:], native["logprobs"][1:], local["logprobs"][1:]
        assert values == pytest.approx(native["logprobs"], abs=1e-6)
        assert values == pytest.approx(local["logprobs"], abs=1e-3)


def test_chat_logprobs_equal_native(server, client):
    native = server.generate({"dialog": MESSAGES, "max_new_tokens": 8, "temperature": 0, "logprobs": True})
    chat = client.chat.completions.create(model="llama", messages=MESSAGES, max_tokens=8, temperature=0,
                                          logprobs=True).choices[0]
    assert [c.token for c in chat.logprobs.content] == native["tokens"]
    # abs 1e-5: float32 sums differ by a few ulps with the rows that other tests' requests batch alongside
    assert [c.logprob for c in chat.logprobs.content] == pytest.approx(native["logprobs"], abs=1e-5)


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["llama"]


@pytest.mark.parametrize("kwargs,param,words", [
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages", "messages[0].role"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, "messages", "alternate"),
    ({"messages": MESSAGES, "n": 9}, "n", "n must be between 1 and 4"),
    ({"messages": MESSAGES, "max_tokens": -5}, "max_tokens", "max_tokens must be between"),
    ({"messages": MESSAGES, "temperature": 5}, "temperature", "temperature must be in"),
    ({"messages": MESSAGES, "presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
    ({"messages": MESSAGES, "logit_bias": {"99999": 1}}, "logit_bias", "vocabulary has ids 0 to 4095"),
    ({"messages": MESSAGES, "logit_bias": {"bad1": 50, "bad2": 20}}, "logit_bias", "got 'bad1', 'bad2'"),
])
def test_chat_bad_requests(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="llama", **kwargs)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and words in e.value.body["message"]


def test_completion_bad_requests(client):
    with pytest.raises(openai.BadRequestError, match="logprobs must be between 0 and 20"):
        client.completions.create(model="llama", prompt=PROMPT, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="max_tokens 0 generates nothing"):
        client.completions.create(model="llama", prompt=PROMPT, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="best_of=3 is not supported"):
        client.completions.create(model="llama", prompt=PROMPT, best_of=3)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt=PROMPT)


def test_unknown_route(server):
    r = server.post({"prompt": PROMPT}, path="/1.0/v1/embeddings")
    assert r.status_code == 404 and "no route /v1/embeddings" in r.json()["error"]["message"]


def metric(text: str, name: str, suffix: str = "") -> float:
    m = re.search(rf'^{name}{suffix}{{[^}}]*ModelName="llama"[^}}]*}} ([0-9.eE+-]+)$', text, re.M)
    assert m, f"{name}{suffix} not in the metrics:\n" + "\n".join(l for l in text.splitlines() if name in l)
    return float(m.group(1))


def test_metrics_count_tokens(server, client):
    before = requests.get(server.metrics_url, timeout=30).text
    counts = {n: metric(before, n) if f"{n}{{" in before else 0.0 for n in ("PromptTokens", "CompletionTokens")}
    ttft_before, tpot_before = (metric(before, n, "_count") if f"{n}_count" in before else 0.0
                                for n in ("TimeToFirstToken", "TimePerOutputToken"))
    results = [client.completions.create(model="llama", prompt=p, max_tokens=n, temperature=0)
               for p, n in ((PROMPT, 7), ("Once upon a time", 11), ("Hello", 3))]
    after = requests.get(server.metrics_url, timeout=30).text
    assert metric(after, "PromptTokens") - counts["PromptTokens"] == sum(r.usage.prompt_tokens for r in results)
    assert metric(after, "CompletionTokens") - counts["CompletionTokens"] == \
        sum(r.usage.completion_tokens for r in results)
    assert metric(after, "TimeToFirstToken", "_count") - ttft_before == 3
    assert metric(after, "TimePerOutputToken", "_count") - tpot_before == \
        sum(r.usage.completion_tokens > 1 for r in results)  # one value per request with a second token
