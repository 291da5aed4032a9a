"""Reliability over HTTP, against a real TorchServe (TP=2 on CPU): malformed requests get a
4xx JSON error and cost no worker; a sustained mixed load is answered exactly once per
request, correctly, without the workers' memory growing; each limit of handler.limits
refuses with a 4xx that names it; and the security defaults hold (token authorization,
no model registration, loopback addresses). The figures go to build/reliability/*.json,
from which docs/reliability.md quotes."""

import json
import os
import random
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests
import torch

import chat_format
from conftest import ROOT, SERVER_SLOTS, TOKENIZER, start_demo_server

NATIVE, COMPLETIONS, CHAT = "", "/1.0/v1/completions", "/1.0/v1/chat/completions"
ROUTES = {NATIVE: "native", COMPLETIONS: "completions", CHAT: "chat"}
FIGURES = os.path.join(ROOT, "build", "reliability")
MAX_REQUEST_SIZE = 2097152  # config.properties
MAX_BODY_BYTES = 1048576  # model-config.yaml handler.limits
WORDS = ("river stone lamp cloud garden winter paper violin harbor candle meadow silver thunder orchard "
         "lantern pebble falcon maple ember canyon").split()


def save_figures(name: str, figures: dict):
    os.makedirs(FIGURES, exist_ok=True)
    with open(os.path.join(FIGURES, f"{name}.json"), "w") as f:
        json.dump(figures, f, indent=1, sort_keys=True)
    print(name, json.dumps(figures, sort_keys=True))


def post(server, path: str, data: bytes, content_type: str | None = "application/json", key="default",
         timeout: float = 120, method: str = "POST") -> requests.Response:
    headers = server.headers(key)
    if content_type is None:
        del headers["Content-Type"]
    else:
        headers["Content-Type"] = content_type
    return requests.request(method, f"{server.url}/predictions/llama{path}", data=data, headers=headers,
                            timeout=timeout)


def error_of(status: int, text: str, path: str) -> dict:
    """The error object of a refusal, in the shape of the route's API."""
    body = json.loads(text)
    if path.startswith("/1.0/v1"):
        assert set(body) == {"error"}, body
        body = body["error"]
        assert body["code"] == status and body["type"] in ("invalid_request_error", "NotFoundError"), body
    else:
        assert body["code"] == status and body["type"] == "invalid_request_error", body
    assert isinstance(body["message"], str) and body["message"], body
    return body


# --- 1. malformed requests --------------------------------------------------------------------

def valid_body(route: str, rng: random.Random) -> dict:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
    if route == "native":
        body = {"dialog": [{"role": "user", "content": prompt}]} if rng.random() < 0.4 else {"prompt": prompt}
        body["max_new_tokens"] = rng.randint(1, 8)
    elif route == "completions":
        body = {"model": "llama", "prompt": prompt, "max_tokens": rng.randint(1, 8)}
    else:
        body = {"model": "llama", "messages": [{"role": "user", "content": prompt}], "max_tokens": rng.randint(1, 8)}
    if rng.random() < 0.5:
        body |= {"temperature": round(rng.uniform(0, 2), 2), "top_p": round(rng.uniform(0.1, 1), 2)}
    if rng.random() < 0.3:
        body["stream"] = True
    return body


def input_field(route: str, body: dict) -> str:
    return "messages" if route == "chat" else ("prompt" if "prompt" in body else "dialog")


# invalid values by field; each of them is refused whatever the rest of the request
BAD_VALUES = {
    "max_new_tokens": [0, -1, 513, 10 ** 12, 2.5, "8", True, [8], {"n": 8}],
    "temperature": [-0.1, 2.01, 1e9, "hot", True, [], {}],
    "top_p": [0, -1, 1.01, "x", False, [0.5]],
    "top_k": [-1, 1 << 40, 1.5, "x", [1]],
    "seed": [-1, 1 << 64, 0.5, "s", {}],
    "stop": ["", [""], [1], ["a"] * 17, {"a": 1}, 5],
    "stream": ["yes", 1, 0, [], {}],
}
BAD_PROMPTS = [5, [], [1], ["a", None], {}, True, ["x"] * (SERVER_SLOTS + 1), "word " * 600]
BAD_DIALOGS = [[], {}, "hi", [{"role": "user"}], [{"role": "robot", "content": "x"}],
               [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
               [{"role": "assistant", "content": "x"}], [{"role": "user", "content": 5}],
               [{"role": "user", "content": "[INST] x"}], [{"role": "usér", "content": "x"}],
               [{"role": "ＵＳＥＲ", "content": "x"}], [{"role": "user\u200b", "content": "x"}],
               [{"role": "\U0001F464", "content": "x"}],
               [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
               [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"} for i in range(65)]]
BAD_OPENAI_FIELDS = {"n": 0, "best_of": 3, "presence_penalty": 2.5, "frequency_penalty": -3, "logit_bias": {"5": 101},
                    "suffix": "end", "tools": [{"type": "function"}], "response_format": {"type": "xml"}}


def mutation(route: str, rng: random.Random) -> tuple[str, bytes, str | tuple]:
    """(what, body bytes, expected error param) for one seeded mutation of a valid request
    that makes it invalid, whatever the random choices."""
    body = valid_body(route, rng)
    field = input_field(route, body)
    ops = ["field", "input", "drop", "extra", "truncate", "bad_byte", "wrap", "nan", "context"]
    op = rng.choice(ops)
    if op == "field":
        name = rng.choice(sorted(BAD_VALUES))
        value = rng.choice(BAD_VALUES[name])
        if name == "max_new_tokens" and route != "native":
            name = rng.choice(["max_tokens", "max_completion_tokens"]) if route == "chat" else "max_tokens"
            body.pop("max_tokens")
        body[name] = value
        return f"{op}:{name}={json.dumps(value)[:20]}", json.dumps(body).encode(), name
    if op == "input":
        value = rng.choice(BAD_PROMPTS if field == "prompt" else BAD_DIALOGS)
        body[field] = value
        params = (field, f"{field}[0]", f"{field}[1]") if field == "prompt" else (field,)
        return f"{op}:{field}={json.dumps(value)[:30]}", json.dumps(body).encode(), params
    if op == "drop":
        del body[field]
        return f"{op}:{field}", json.dumps(body).encode(), ("prompt", "messages")
    if op == "extra":
        if route == "native":
            name = rng.choice(["max_tokens", "best_of", "model", "dialogue", "Prompt", "\u00fcber"])
            body[name] = 1
            return f"{op}:{name}", json.dumps(body).encode(), name
        name = rng.choice(sorted(BAD_OPENAI_FIELDS))
        body[name] = BAD_OPENAI_FIELDS[name]
        return f"{op}:{name}", json.dumps(body).encode(), name
    raw = json.dumps(body).encode()
    if op == "truncate":
        return f"{op}", raw[:rng.randrange(len(raw))], "body"
    if op == "bad_byte":
        at = rng.randrange(len(raw) + 1)
        return f"{op}", raw[:at] + bytes([rng.choice([0xff, 0xfe, 0xc0, 0xc1, 0xf5])]) + raw[at:], "body"
    if op == "wrap":
        return f"{op}", b"[" + raw + b"]", ("body", None)
    if op == "nan":
        name = rng.choice(["temperature", "top_p", "seed", "max_tokens" if route != "native" else "max_new_tokens"])
        constant = rng.choice(["NaN", "Infinity", "-Infinity"])
        return f"{op}:{name}={constant}", raw[:-1] + f', "{name}": {constant}}}'.encode(), "body"
    # context: a prompt that fits, with more new tokens than the context has room for
    body[field] = "word " * 300 if field == "prompt" else [{"role": "user", "content": "word " * 300}]
    name = "max_new_tokens" if route == "native" else "max_tokens"
    body[name] = 300
    return f"{op}", json.dumps(body).encode(), name


def hand_written() -> list[tuple]:
    """(what, path, body bytes, content type, expected status, expected param or (), words)"""
    cases = []
    for path in ROUTES:
        field = "messages" if path == CHAT else "prompt"
        ok = {field: [{"role": "user", "content": "hi"}] if path == CHAT else "hi"}
        P = ("body", None)
        cases += [
            ("empty body", path, b"", None, 400, "body", "empty"),
            ("empty json body", path, b"", "application/json", 400, "body", "empty"),
            ("whitespace", path, b"  \n ", "application/json", 400, "body", "not valid JSON"),
            ("null", path, b"null", "application/json", 400, P, "must be a JSON object"),
            ("number", path, b"5", "application/json", 400, P, "must be a JSON object"),
            ("true", path, b"true", "application/json", 400, P, "must be a JSON object"),
            ("string", path, b'"text"', "application/json", 400, P, "must be a JSON object"),
            ("json in a string", path, json.dumps(json.dumps(ok)).encode(), "application/json", 400, P,
             "must be a JSON object"),
            ("list", path, json.dumps([ok]).encode(), "application/json", 400, P, "must be a JSON object"),
            ("unclosed", path, b'{"prompt": "a"', "application/json", 400, "body", "not valid JSON"),
            ("trailing comma", path, b'{"prompt": "a",}', "application/json", 400, "body", "not valid JSON"),
            ("single quotes", path, b"{'prompt': 'a'}", "application/json", 400, "body", "not valid JSON"),
            ("invalid utf-8", path, b'{"prompt": "\xc3\x28"}', "application/json", 400, "body", "UTF-8"),
            ("utf-16", path, json.dumps(ok).encode("utf-16"), "application/json", 400, "body", "UTF-8"),
            ("byte order mark", path, b"\xef\xbb\xbf" + json.dumps(ok).encode(), "application/json", 400, "body",
             "not valid JSON"),
            ("nested 100000 deep", path, b"[" * 100_000 + b"]" * 100_000, "application/json", 400, "body",
             "nests arrays and objects more than 64 levels deep"),
            ("nested object in a field", path, json.dumps(ok)[:-1].encode() + b', "x": ' + b"[" * 50_000
             + b"]" * 50_000 + b"}", "application/json", 400, "body", "nests arrays and objects more than 64 levels deep"),
            ("NaN", path, json.dumps(ok)[:-1].encode() + b', "temperature": NaN}', "application/json", 400, "body",
             "NaN is not a JSON number"),
            ("Infinity", path, json.dumps(ok)[:-1].encode() + b', "top_p": -Infinity}', "application/json", 400,
             "body", "Infinity is not a JSON number"),
            ("1e999", path, json.dumps(ok)[:-1].encode() + b', "temperature": 1e999}', "application/json", 400,
             "temperature", "finite number"),
            ("5000-digit integer", path, json.dumps(ok)[:-1].encode() + b', "seed": ' + b"9" * 5000 + b"}",
             "application/json", 400, "body", "not valid JSON"),
            ("huge integer", path, json.dumps(ok | {"seed": 10 ** 300}).encode(), "application/json", 400, "seed",
             "seed must be between"),
            ("lone surrogate", path, json.dumps({field: "a\ud800b" if path != CHAT else
                                                 [{"role": "user", "content": "\udfff"}]}).encode(),
             "application/json", 400, "body", "surrogate"),
            *[(f"role {role!r}", path, json.dumps({"dialog" if path == NATIVE else "messages": [
                {"role": role, "content": "hi"}]}).encode(), "application/json", 400,
               "dialog" if path == NATIVE else "messages", "role must be one of")
              for role in ("usér", "ＵＳＥＲ", "user\u200b", "\U0001F464", "user ", "") if path != COMPLETIONS],
            ("form content type", path, b"prompt=hi", "application/x-www-form-urlencoded", 415, "body",
             "Content-Type: application/json"),
            ("xml content type", path, b"<prompt>hi</prompt>", "application/xml", 400, "body", "not valid JSON"),
            ("over max_body_bytes", path, json.dumps(ok | {"stop": ["x" * (MAX_BODY_BYTES + 10)]}).encode(),
             "application/json", 413, "body", f"the limit is {MAX_BODY_BYTES}"),
            ("over max_body_bytes as text/plain", path, json.dumps(ok | {"stop": ["x" * (MAX_BODY_BYTES + 10)]})
             .encode(), "text/plain", 413, "body", f"the limit is {MAX_BODY_BYTES}"),
            # refused by TorchServe's frontend before the handler: a bare 413, no JSON
            ("over max_request_size", path, json.dumps({field: "x" * MAX_REQUEST_SIZE}).encode(),
             "application/json", 413, None, None),
        ]
    return cases + [
        ("GET without a body", NATIVE, None, None, 400, "body", "empty"),
        ("unknown route", "/1.0/v1/embeddings", b'{"input": "a"}', "application/json", 404, "url", "no route"),
        ("unknown model", COMPLETIONS, b'{"model": "gpt-4", "prompt": "a"}', "application/json", 404, "model",
         "does not exist"),
        ("model as a list", CHAT, b'{"model": ["llama"], "messages": []}', "application/json", 404, "model",
         "does not exist"),
        ("too many top logprobs", COMPLETIONS, b'{"prompt": "a", "logprobs": 21}', "application/json", 400,
         "logprobs", "between 0 and 20"),
        ("stream with logprobs", CHAT, b'{"messages": [{"role": "user", "content": "a"}], "logprobs": true, '
         b'"stream": true}', "application/json", 400, "logprobs", "not supported with stream"),
        ("image part", CHAT, json.dumps({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}).encode(), "application/json", 400,
         "messages", "only text parts"),
        ("stream_options not an object", COMPLETIONS, b'{"prompt": "a", "stream_options": "yes"}',
         "application/json", 400, "stream_options", "must be an object"),
        ("echo in chat", NATIVE, b'{"dialog": [{"role": "user", "content": "a"}], "echo": true}',
         "application/json", 400, "echo", "only for text"),
        ("prompt and dialog", NATIVE, b'{"prompt": "a", "dialog": [{"role": "user", "content": "a"}]}',
         "application/json", 400, "prompt", "exactly one"),
        ("multipart without a body part", NATIVE, b"--B\r\nContent-Disposition: form-data; name=\"file\"; "
         b"filename=\"a.json\"\r\nContent-Type: application/json\r\n\r\n{}\r\n--B--\r\n",
         "multipart/form-data; boundary=B", 415, "body", "no JSON body"),
    ]


def mutated(n_per_route: int, seed: int = 20240601) -> list[tuple]:
    rng = random.Random(seed)
    cases = []
    for i in range(n_per_route * 3):
        path = list(ROUTES)[i % 3]
        what, raw, param = mutation(ROUTES[path], rng)
        cases.append((f"mutation {i} {ROUTES[path]} {what}", path, raw, "application/json",
                      (400, 413), param, None))
    return cases


def test_unmutated_requests_are_valid(server):
    """The control for the mutations: the valid requests they start from are answered."""
    rng = random.Random(5)
    for i in range(12):
        path = list(ROUTES)[i % 3]
        body = valid_body(ROUTES[path], rng)
        r = post(server, path, json.dumps(body).encode())
        assert r.status_code == 200, (body, r.text[:300])
        if not body.get("stream"):
            assert "usage" in r.json()
        elif path == NATIVE:  # its last line (one per prompt) says how the generation ended
            assert "finish_reason" in json.loads(r.text.splitlines()[-1]), r.text[-300:]
        else:
            assert r.text.endswith("data: [DONE]\n\n"), r.text[-300:]


def test_malformed_requests(server, demo_llama):
    cases = hand_written() + mutated(60)
    assert len(cases) >= 200

    def send(case):
        what, path, raw, content_type, status, param, words = case
        method = "GET" if raw is None else "POST"
        try:
            r = post(server, path, raw, content_type, method=method, timeout=60)
        except requests.ConnectionError as e:  # TorchServe may close the connection on a body over its limit
            return case, None, repr(e)
        return case, r.status_code, r.text

    start = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(send, cases))
    elapsed = time.perf_counter() - start
    statuses, failures = Counter(), []
    for case, status, text in results:
        what, path, raw, content_type, expected, param, words = case
        statuses[status] += 1
        try:
            assert status in (expected if isinstance(expected, tuple) else (expected,)), (status, text[:300])
            if param is None and words is None:  # TorchServe's own 413: no body, or its JSON
                assert not text or json.loads(text)["code"] == 413
                continue
            error = error_of(status, text, path)
            params = param if isinstance(param, tuple) else (param,)
            assert error["param"] in params, (error, params)
            assert words is None or words in error["message"], (error, words)
        except (AssertionError, ValueError, KeyError) as e:
            failures.append(f"{what} on /{path}: {e}")
    assert not failures, "\n".join(failures)

    # nothing crashed: the same two ranks, and they still answer right
    assert server.worker_pids() == server.initial_pids and len(server.initial_pids) == 2
    prompt = "The secret of a happy life is"
    answer = server.generate({"prompt": prompt, "temperature": 0, "max_new_tokens": 16})
    assert answer == demo_llama.text_completion([prompt], 16, temperature=0)[0]
    save_figures("malformed", {"requests": len(cases), "hand_written": len(cases) - 180, "mutations": 180,
                               "by_status": {str(k): v for k, v in sorted(statuses.items(), key=str)},
                               "worker_restarts": 0, "seconds": round(elapsed, 1)})


def test_tiny_temperature_decodes_greedily(server, demo_llama):
    """temperature 1e-40 once made sampling meet NaN; the request failed and its KV-cache slot
    stayed taken, so every later request failed too. Now it is greedy, next to other requests."""
    body = {"prompt": "Once upon a time", "max_new_tokens": 12}
    with ThreadPoolExecutor(3) as pool:
        tiny = pool.submit(server.generate, body | {"temperature": 1e-40})
        other = pool.submit(server.generate, {"prompt": "Tell me", "max_new_tokens": 12, "temperature": 0})
        assert tiny.result() == server.generate(body | {"temperature": 0})
        assert other.result() == demo_llama.text_completion(["Tell me"], 12, temperature=0)[0]
    assert server.worker_pids() == server.initial_pids


# --- 2. sustained load ----------------------------------------------------------------------

SOAK_REQUESTS, SOAK_CLIENTS, SOAK_WARMUP = 300, 16, 48
SHAPES = [("native", False), ("native", True), ("openai", False), ("openai", True)]


def soak_specs() -> list[dict]:
    """Blocks of four requests that share chat/text and sampling settings (so that one
    in-process call gives their answers) with distinct prompts, lengths and routes."""
    rng = random.Random(7)
    specs = []
    for block in range(SOAK_REQUESTS // 4):
        chat, seeded = block % 2 == 1, block % 3 == 2
        sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + block} if seeded else \
            {"temperature": 0.0, "top_p": 1.0}
        for j in range(4):
            i = len(specs)
            api_name, stream = SHAPES[(j + block) % 4]
            prompt = f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
            specs.append({"i": i, "block": block, "chat": chat, "api": api_name, "stream": stream,
                          "prompt": prompt, "max_new_tokens": 3 + (i * 5) % 12, "sampling": sampling})
    return specs


def soak_body(spec: dict) -> tuple[str, dict]:
    s = spec["sampling"]
    if spec["api"] == "native":
        body = {"dialog": [{"role": "user", "content": spec["prompt"]}]} if spec["chat"] else {"prompt": spec["prompt"]}
        body |= {"max_new_tokens": spec["max_new_tokens"], "stream": spec["stream"]} | s
        return NATIVE, body
    body = {"model": "llama", "max_tokens": spec["max_new_tokens"], "stream": spec["stream"]} | s
    body |= {"messages": [{"role": "user", "content": spec["prompt"]}]} if spec["chat"] else {"prompt": spec["prompt"]}
    if spec["stream"]:
        body["stream_options"] = {"include_usage": True}
    return (CHAT if spec["chat"] else COMPLETIONS), body


def read_answer(spec: dict, r: requests.Response) -> dict:
    """The answer as {text, finish_reason, usage, id}, after checking that it is well formed
    for its API and streaming mode (one end, one usage, nothing after it)."""
    assert r.status_code == 200, r.text[:300]
    rid = r.headers["x-request-id"]
    if spec["api"] == "native":
        if not spec["stream"]:
            a = r.json()
            assert set(a) == {"generation", "finish_reason", "usage"}, a
            gen = a["generation"]
            if spec["chat"]:
                assert set(gen) == {"role", "content"} and gen["role"] == "assistant"
                gen = gen["content"]
            return {"text": gen, "finish_reason": a["finish_reason"], "usage": a["usage"], "id": rid}
        lines = [json.loads(line) for line in r.text.splitlines() if line]
        assert all(set(c) == {"text"} for c in lines[:-1]), lines
        last = lines[-1]
        assert set(last) == {"text", "finish_reason", "usage"} and last["text"] == "", last
        return {"text": "".join(c["text"] for c in lines), "finish_reason": last["finish_reason"],
                "usage": last["usage"], "id": rid}
    kind = "chat.completion" if spec["chat"] else "text_completion"
    if not spec["stream"]:
        a = r.json()
        assert a["object"] == kind and a["model"] == "llama" and a["id"].endswith(rid) and len(a["choices"]) == 1
        choice = a["choices"][0]
        text = choice["message"]["content"] if spec["chat"] else choice["text"]
        usage = a["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        return {"text": text, "finish_reason": choice["finish_reason"], "id": rid,
                "usage": {k: usage[k] for k in ("prompt_tokens", "completion_tokens")}}
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]", events[-3:]
    assert sum(e == "data: [DONE]" for e in events) == 1
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and sum("usage" in c for c in chunks) == 1
    choices = [c["choices"][0] for c in chunks[:-1]]
    assert all(c["object"] == kind + (".chunk" if spec["chat"] else "") for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].endswith(rid)
    finishes = [c["finish_reason"] for c in choices if c["finish_reason"]]
    assert len(finishes) == 1 and choices[-1]["finish_reason"] == finishes[0]
    text = "".join((c["delta"].get("content") or "") if spec["chat"] else c["text"] for c in choices)
    usage = usage_chunk["usage"]
    return {"text": text, "finish_reason": finishes[0], "id": rid,
            "usage": {k: usage[k] for k in ("prompt_tokens", "completion_tokens")}}


def expected_answers(demo_llama, specs: list[dict]) -> dict[int, dict]:
    """Each request's answer from the model in this process, one call per block of four (on
    one thread: tiny matrices, and the server's ranks need the cores too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {i: a for block in sorted({s["block"] for s in specs})
                for i, a in expected_block(demo_llama, [s for s in specs if s["block"] == block]).items()}
    finally:
        torch.set_num_threads(threads)


def expected_block(demo_llama, group: list[dict]) -> dict[int, dict]:
    first = group[0]
    options = {"temperature": first["sampling"]["temperature"], "top_p": first["sampling"]["top_p"]}
    if "seed" in first["sampling"]:
        options["seed"] = first["sampling"]["seed"]
    lengths = [s["max_new_tokens"] for s in group]
    if first["chat"]:
        dialogs = [[{"role": "user", "content": s["prompt"]}] for s in group]
        preds = demo_llama.chat_completion(dialogs, lengths, **options)
    else:
        preds = demo_llama.text_completion([s["prompt"] for s in group], lengths,
                                         **options)
    return {s["i"]: {"text": p["generation"]["content"] if first["chat"] else p["generation"],
                     "finish_reason": p["finish_reason"], "usage": p["usage"]} for s, p in zip(group, preds)}


def workers_rss(server) -> int:
    return sum(psutil.Process(pid).memory_info().rss for pid in server.worker_pids())


@pytest.mark.timeout(600)
def test_sustained_mixed_load(server, demo_llama):
    specs = soak_specs()
    expected = expected_answers(demo_llama, specs)
    order = list(range(len(specs)))
    random.Random(11).shuffle(order)
    answers: dict[int, list] = {i: [] for i in order}
    errors = []

    def one(i):
        spec = specs[i]
        path, body = soak_body(spec)
        try:
            r = server.post(body, path=path, stream=spec["stream"])
            answers[i].append(read_answer(spec, r))
        except Exception as e:  # recorded, judged below with the others
            errors.append(f"request {i} {spec['api']} chat={spec['chat']} stream={spec['stream']}: {e!r}")

    pids = server.worker_pids()
    start = time.perf_counter()
    with ThreadPoolExecutor(SOAK_CLIENTS) as pool:
        list(pool.map(one, order[:SOAK_WARMUP]))
    warm_rss = workers_rss(server)
    peak = [warm_rss]
    done = threading.Event()

    def sample():
        while not done.wait(0.5):
            peak[0] = max(peak[0], workers_rss(server))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with ThreadPoolExecutor(SOAK_CLIENTS) as pool:
        list(pool.map(one, order[SOAK_WARMUP:]))
    elapsed = time.perf_counter() - start
    done.set()
    sampler.join()
    end_rss = workers_rss(server)

    assert not errors, "\n".join(errors[:20])
    assert all(len(a) == 1 for a in answers.values())  # each request answered exactly once
    ids = [a[0]["id"] for a in answers.values()]
    assert len(set(ids)) == len(specs)  # and no answer came twice
    wrong = []
    for i, (got,) in answers.items():
        spec, want = specs[i], expected[i]
        tokenizer = demo_llama.tokenizer
        prompt_tokens = len(chat_format.encode_dialog(tokenizer, [{"role": "user", "content": spec["prompt"]}])
                            if spec["chat"] else tokenizer.encode(spec["prompt"], bos=True, eos=False))
        usage = dict(got["usage"])
        if spec["api"] == "openai" and not spec["chat"] and got["finish_reason"] == "stop":
            usage["completion_tokens"] -= 1  # the stop id that ended it: OpenAI's completions count it, as vLLM's
        n = usage["completion_tokens"]
        ok = (usage["prompt_tokens"] == prompt_tokens and 0 <= n <= spec["max_new_tokens"]
              and got["finish_reason"] == ("length" if n == spec["max_new_tokens"] else "stop"))
        if not ok or {k: got[k] for k in want} | {"usage": usage} != want:
            wrong.append((i, spec["api"], spec["chat"], spec["stream"], got, want))
    assert not wrong, wrong[:5]
    assert server.worker_pids() == pids
    growth = (end_rss - warm_rss) / warm_rss
    peak_growth = (peak[0] - warm_rss) / warm_rss
    kinds = Counter(f"{s['api']}-{'chat' if s['chat'] else 'text'}-{'stream' if s['stream'] else 'whole'}"
                    for s in specs)
    save_figures("soak", {"requests": len(specs), "clients": SOAK_CLIENTS, "slots": SERVER_SLOTS,
                          "kinds": dict(sorted(kinds.items())), "greedy": sum(s["sampling"]["temperature"] == 0
                                                                              for s in specs),
                          "answered": sum(len(a) for a in answers.values()), "errors": len(errors),
                          "wrong": len(wrong), "seconds": round(elapsed, 1),
                          "requests_per_s": round(len(specs) / elapsed, 2), "worker_restarts": 0,
                          "rss_after_warmup_mb": round(warm_rss / 2 ** 20, 1),
                          "rss_end_mb": round(end_rss / 2 ** 20, 1), "rss_peak_mb": round(peak[0] / 2 ** 20, 1),
                          "rss_growth_pct": round(100 * growth, 2), "rss_peak_growth_pct": round(100 * peak_growth, 2)})
    assert growth <= 0.10 and peak_growth <= 0.10, (warm_rss, end_rss, peak[0])


# --- 4. limits --------------------------------------------------------------------------------

LIMITS = {"max_new_tokens": 32, "max_prompt_tokens": 40, "max_prompts": 2, "max_messages": 3, "max_body_bytes": 4096}
# 8 KV blocks of 16 tokens: one max_seq_len of 128 fits; a sequence of the limits takes 5
# (40 + 32 tokens), and four at once preempt each other
KV_BLOCKS, LIMITED_SEQ_LEN = 8, 128


@pytest.fixture(scope="module")
def small_llama(checkpoints):
    """What the limited server serves, in this process (TP=1, a cache for every slot):
    conftest's 2-layer checkpoint with DEMO's tokenizer, whose graphs compile in about half
    the time of DEMO's 8 layers (the server started in 13.9 s against 24.6 s here)."""
    from llama2 import tp_llama

    return tp_llama(None, checkpoints["gqa"][1]["hf"], TOKENIZER, 1, max_batch_size=SERVER_SLOTS,
                    max_seq_len=LIMITED_SEQ_LEN)


@pytest.fixture(scope="module")
def limited(tmp_path_factory, small_llama, checkpoints):
    """A second TorchServe whose handler.limits are small, its context and KV cache too, and
    which compiles its decode step (handler.compile), so that the compiled path is served end
    to end too. At TP=1: one rank compiles, where two compiled the same graphs (35.8 s of the
    suite's set-ups); compiled steps at TP=2, as served (cpp_wrapper), are test_tp.py's."""
    kv_cache_bytes = KV_BLOCKS * small_llama.runner.kv_block_bytes()
    srv = start_demo_server(tmp_path_factory.mktemp("limited"), tp=1, weights=checkpoints["gqa"][1]["hf"],
                            limits=LIMITS, compile=True, kv_cache_bytes=kv_cache_bytes, max_seq_len=LIMITED_SEQ_LEN)
    yield srv
    srv.stop(wait=False)


def prompt_of(tokenizer, n_tokens: int) -> str:
    """A text prompt of exactly n_tokens tokens (with BOS): single letters are a token each."""
    text = " ".join("abcdefgh"[i % 8] for i in range(n_tokens - 1))
    assert len(tokenizer.encode(text, bos=True, eos=False)) == n_tokens
    return text


def refused(server, body, path, status, param, words):
    r = server.post(body, path=path)
    assert r.status_code == status, r.text
    error = error_of(r.status_code, r.text, path)
    assert error["param"] == param and all(w in error["message"] for w in words), error
    return error


def test_compiled_server_answers_as_in_process(limited, small_llama):
    prompts = ["The secret of a happy life is", "Once upon a time"]
    answers = limited.generate({"prompt": prompts, "max_new_tokens": 24, "temperature": 0})
    assert answers == small_llama.text_completion(prompts, 24, temperature=0)
    assert "compiled the decode step" in limited.log()


def test_preempted_requests_keep_their_prompt_logprobs(limited, small_llama):
    """Two requests of two 39-token prompts each, echo and logprobs as lm-eval asks for
    loglikelihoods, on 8 KV blocks: their sequences preempt each other, and every answer,
    prompt logprobs included, is what the in-process model gives with a cache for all."""
    a = prompt_of(small_llama.tokenizer, 39)
    b = " ".join("hgfedcba"[i % 8] for i in range(38))
    prompts = [[a, b], [b, a]]
    bodies = [{"prompt": p, "max_tokens": 32, "temperature": 0, "echo": True, "logprobs": 1, "ignore_eos": True}
              for p in prompts]  # every sequence grows to 5 blocks
    before = re.findall(r"done \S+ rank=0 .* preemptions=(\d+)", limited.log())
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda b: limited.post(b, COMPLETIONS), bodies))
    preemptions = [int(n) for n in re.findall(r"done \S+ rank=0 .* preemptions=(\d+)", limited.log())]
    assert preemptions[-1] > (int(before[-1]) if before else 0), "no sequence was preempted"
    for r, body in zip(answers, bodies):
        assert r.status_code == 200, r.text
        local = small_llama.text_completion(body["prompt"], 32, temperature=0, logprobs=True, echo=True,
                                           ignore_eos=True)
        for choice, want in zip(r.json()["choices"], local):
            values = choice["logprobs"]["token_logprobs"]
            assert choice["text"] == want["generation"]  # the prompt, then the answer
            assert values[0] is None and values[1:] == pytest.approx(want["logprobs"][1:], abs=1e-3)


def test_limit_max_new_tokens(limited):
    cap = LIMITS["max_new_tokens"]
    answer = limited.generate({"prompt": "Once upon a time", "max_new_tokens": cap, "temperature": 0})
    assert answer["usage"]["completion_tokens"] <= cap
    # the default (64 in model-config.yaml) is cut to the cap
    assert limited.generate({"prompt": "Once upon a time", "temperature": 0}) == answer
    refused(limited, {"prompt": "a", "max_new_tokens": cap + 1}, NATIVE, 400, "max_new_tokens", [f"1 and {cap}"])
    # 0 scores a prompt (with echo) on the completions route
    refused(limited, {"prompt": "a", "max_tokens": cap + 1}, COMPLETIONS, 400, "max_tokens", [f"0 and {cap}"])
    refused(limited, {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": cap + 1}, CHAT, 400,
            "max_completion_tokens", [f"1 and {cap}"])


def test_limit_prompt_tokens(limited, small_llama):
    n = LIMITS["max_prompt_tokens"]
    fits, over = prompt_of(small_llama.tokenizer, n), prompt_of(small_llama.tokenizer, n + 1)
    assert limited.generate({"prompt": fits, "max_new_tokens": 2})["usage"]["prompt_tokens"] == n
    refused(limited, {"prompt": over, "max_new_tokens": 2}, NATIVE, 400, "prompt", [f"{n + 1} tokens", f"limit is {n}"])
    refused(limited, {"prompt": ["a", over], "max_new_tokens": 2}, COMPLETIONS, 400, "prompt[1]",
            [f"limit is {n}"])
    refused(limited, {"messages": [{"role": "user", "content": over}]}, CHAT, 400, "messages", [f"limit is {n}"])


def test_limit_prompts_per_request(limited):
    n = LIMITS["max_prompts"]
    assert len(limited.generate({"prompt": ["a"] * n, "max_new_tokens": 2})) == n
    refused(limited, {"prompt": ["a"] * (n + 1)}, NATIVE, 400, "prompt", [f"{n + 1} prompts", f"limit is {n}"])
    refused(limited, {"prompt": ["a"] * (n + 1)}, COMPLETIONS, 400, "prompt", [f"limit is {n}"])
    # n answers per prompt take n slots
    assert len(limited.generate({"prompt": "a", "n": n, "max_new_tokens": 2})) == n
    refused(limited, {"prompt": "a", "n": n + 1}, COMPLETIONS, 400, "n", [f"between 1 and {n}"])
    refused(limited, {"prompt": ["a", "b"], "n": 2}, NATIVE, 400, "n", ["4 sequences", f"limit is {n}"])


def test_limit_messages_per_dialog(limited):
    n = LIMITS["max_messages"]
    dialog = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(n)]
    assert limited.generate({"dialog": dialog, "max_new_tokens": 2})["generation"]["role"] == "assistant"
    longer = [{"role": "system", "content": "Be brief."}] + dialog
    refused(limited, {"dialog": longer}, NATIVE, 400, "dialog", [f"{n + 1} messages", f"limit is {n}"])
    refused(limited, {"messages": longer}, CHAT, 400, "messages", [f"limit is {n}"])


def test_limit_body_bytes(limited):
    n = LIMITS["max_body_bytes"]
    body = {"prompt": "a", "max_new_tokens": 2, "stop": ["x"] * 8}  # 8 stop strings fill it (each at most 512)
    fill = n - len(json.dumps(body))
    body["stop"] = ["x" * (1 + fill // 8 + (i == 0) * (fill % 8)) for i in range(8)]
    assert len(json.dumps(body)) == n
    assert limited.post(body).status_code == 200
    body["stop"][0] += "x"
    for path in (NATIVE, COMPLETIONS):
        refused(limited, body, path, 413, "body", [f"{n + 1} bytes", f"limit is {n}"])


def test_inference_key_rotates(limited):
    """key_file.json's API key replaces the inference key (GET /token?type=inference on the
    management port); the old key stops working at once. (On this server: the shared one's
    key must stay.)"""
    key_file = os.path.join(limited.workdir, "key_file.json")
    with open(key_file) as f:
        keys = json.load(f)
    old = keys["inference"]["key"]
    assert limited.post({"prompt": "a", "max_new_tokens": 1}, key=old).status_code == 200
    r = requests.get(f"http://127.0.0.1:{limited.ports['management']}/token", params={"type": "inference"},
                     headers={"Authorization": f"Bearer {keys['API']['key']}"}, timeout=30)
    assert r.status_code == 200, r.text
    with open(key_file) as f:
        new = json.load(f)["inference"]["key"]
    assert new != old
    r = limited.post({"prompt": "a", "max_new_tokens": 1}, key=old)
    assert r.status_code in (400, 401) and r.json()["type"] == "InvalidKeyException"
    assert limited.post({"prompt": "a", "max_new_tokens": 1}, key=new).status_code == 200
    limited.key = new


# --- 5. security defaults -------------------------------------------------------------------

def properties() -> dict:
    with open(os.path.join(ROOT, "config.properties")) as f:
        return dict(line.split("=", 1) for line in f.read().splitlines() if line and not line.startswith("#"))


def test_config_is_loopback_authorized_and_closed():
    props = properties()
    for key in ("inference_address", "management_address", "metrics_address"):
        assert re.fullmatch(r"https?://127\.0\.0\.1:\d+", props[key]), (key, props[key])
    assert props["grpc_inference_address"] == props["grpc_management_address"] == "127.0.0.1"
    assert props["disable_token_authorization"] == "false"
    assert props["enable_model_api"] == "false"
    allowed = props["allowed_urls"].replace("\\\\", "\\")  # a .properties value: \\ is one backslash
    assert not any(re.fullmatch(p, url) for p in allowed.split(",")
                   for url in ("https://example.com/llama.mar", "http://10.0.0.1/llama.mar", "s3://bucket/llama.mar"))


def test_server_listens_on_loopback_only(server):
    """The frontend's ports (HTTP, gRPC, management, metrics) and the ranks' sockets are
    loopback. The one exception is torchrun's c10d stores (rendezvous and master port), which
    PyTorch binds to every interface: see docs/reliability.md."""
    java = server.frontend()
    loopback = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}
    listening = {}
    for p in [java] + java.children(recursive=True):
        try:
            connections = p.net_connections(kind="inet")
        except psutil.NoSuchProcess:  # a short-lived child gone since the listing: it listens on nothing
            continue
        for c in connections:
            if c.status == psutil.CONN_LISTEN:
                listening.setdefault(p.pid, []).append(c.laddr)
    assert len(listening.get(java.pid, [])) >= 5  # inference, management, metrics, 2 x gRPC
    exposed = {pid: [a for a in addrs if a.ip not in loopback] for pid, addrs in listening.items()}
    exposed = {pid: addrs for pid, addrs in exposed.items() if addrs}
    for pid in exposed:
        assert "torchrun" in " ".join(psutil.Process(pid).cmdline()), (pid, exposed[pid])


@pytest.mark.parametrize("path", [NATIVE, COMPLETIONS, CHAT])
@pytest.mark.parametrize("key", [None, "wrong", "management"])
def test_inference_needs_its_key(server, path, key):
    if key == "management":
        with open(os.path.join(server.workdir, "key_file.json")) as f:
            key = json.load(f)["management"]["key"]
    body = {"messages": [{"role": "user", "content": "a"}]} if path == CHAT else {"prompt": "a"}
    r = server.post(body | {"max_tokens" if path else "max_new_tokens": 1}, path=path, key=key)
    # TorchServe 0.12.0 answers a failed token check with 400 (InvalidKeyException), not 401
    assert r.status_code in (400, 401) and r.json()["type"] == "InvalidKeyException", r.text


def test_management_api_needs_its_key_and_registers_nothing(server):
    with open(os.path.join(server.workdir, "key_file.json")) as f:
        keys = json.load(f)
    mgmt = f"http://127.0.0.1:{server.ports['management']}"
    auth = {"Authorization": f"Bearer {keys['management']['key']}"}
    for headers in ({}, {"Authorization": f"Bearer {keys['inference']['key']}"}):
        r = requests.get(f"{mgmt}/models", headers=headers, timeout=30)
        assert r.status_code in (400, 401) and r.json()["type"] == "InvalidKeyException"
    r = requests.get(f"{mgmt}/models", headers=auth, timeout=30)
    assert r.status_code == 200 and [m["modelName"] for m in r.json()["models"]] == ["llama"]
    for url in ("https://example.com/evil.mar", "file:///tmp/evil.mar"):
        r = requests.post(f"{mgmt}/models", params={"url": url, "initial_workers": 1}, headers=auth, timeout=30)
        assert r.status_code == 405 and r.json()["type"] == "MethodNotAllowedException", r.text
    r = requests.delete(f"{mgmt}/models/llama", headers=auth, timeout=30)
    assert r.status_code == 405
    assert [m["modelName"] for m in requests.get(f"{mgmt}/models", headers=auth, timeout=30).json()["models"]] \
        == ["llama"]
    assert server.generate({"prompt": "a", "max_new_tokens": 1})["usage"]["completion_tokens"] == 1
