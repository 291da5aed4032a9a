"""Continuous batching through a real TorchServe (4 KV-cache slots, TP=2): requests of
every kind share the batch, each gets exactly its own answer, the ranks agree, and no
slot leaks."""

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import decoded_after_leaving
from injected import FAULT

CHAT = [{"role": "user", "content": "Tell me about the sea."}]


def mixed_requests() -> list[dict]:
    """16 requests: text and chat, streamed and not, greedy and seeded, unseeded sampling,
    different lengths."""
    bodies = []
    for i in range(16):
        body = {"prompt": f"Story number {i}: once upon a time"} if i % 3 else {"dialog": CHAT}
        body["max_new_tokens"] = 5 + 7 * (i % 5)
        if i % 4 == 0:
            body |= {"temperature": 0.8, "top_p": 0.9, "seed": 100 + i}
        elif i % 4 == 1:
            body |= {"temperature": 0}
        elif i % 4 == 2:
            body |= {"temperature": 0, "stream": True}
        else:
            body |= {"temperature": 1.0, "top_k": 20}  # unseeded: only its own shape is known
        bodies.append(body)
    return bodies


def ask(server, body: dict) -> dict:
    """The answer as one dict, whether it came streamed or whole."""
    if not body.get("stream"):
        return server.generate(body)
    chunks = server.stream(body)
    text = "".join(c["text"] for c in chunks)
    last = chunks[-1]
    return {"generation": {"role": "assistant", "content": text} if "dialog" in body else text,
            "finish_reason": last["finish_reason"], "usage": last["usage"]}


def test_mixed_requests_share_four_slots(server):
    bodies = mixed_requests()
    alone = [ask(server, b) for b in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda b: ask(server, b), bodies))
    for body, single, batched in zip(bodies, alone, together):
        assert batched["usage"]["completion_tokens"] <= body["max_new_tokens"]
        assert isinstance(batched["generation"], dict) == ("dialog" in body)
        if "seed" in body or body["temperature"] == 0:
            assert batched == single, body
    assert slots_in_use(server) == 0


def gauge(server, name: str) -> float:
    text = requests.get(server.metrics_url, timeout=30).text
    m = re.search(rf'^{name}\{{[^}}]*\}} ([0-9.]+)$', text, re.M)
    assert m, f"{name} missing from the metrics"
    return float(m.group(1))


def slots_in_use(server) -> float:
    """KV-cache blocks held and sequences running or waiting, as the last iteration left them."""
    return gauge(server, "KVBlocksInUse") + gauge(server, "SequencesRunning") + gauge(server, "SequencesWaiting")


def test_ranks_admit_and_decode_alike(server):
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda b: ask(server, b), mixed_requests()[:8]))
    deadline = time.time() + 10
    while True:  # each rank writes its own lines: rank 1's last ones may come a moment later
        lines = re.findall(r"done (\S+) rank=(\d) (seqs=\[[\d, ]*\] tokens=\w+ decisions=\w+)", server.log())
        by_rank = {"0": {}, "1": {}}
        for req_id, rank, what in lines:
            by_rank[rank][req_id] = what
        if by_rank["0"].keys() == by_rank["1"].keys() or time.time() > deadline:
            break
        time.sleep(0.5)
    assert len(by_rank["0"]) >= 8
    assert by_rank["0"] == by_rank["1"]


LONG = {"prompt": "A very long story:", "max_new_tokens": 120, "temperature": 0}  # no EOS before 400 tokens


def tokens_past_leaving(server, read: int) -> list[int]:
    """Three tries of a stream whose client reads `read` lines and closes: the tokens each
    generated past those read, each far from LONG's max_new_tokens. A client slow to read (a
    full suite's load on the other core) leaves more tokens on their way when it closes (9
    more once, 4 more once): the best of the three is judged; a server that ignored the close
    would fail all three."""
    tries = []
    for _ in range(3):
        received, generated = decoded_after_leaving(server, LONG, read)
        assert all(received)  # one token a line (steps_per_iteration 1; no character split here)
        assert len(received) <= generated < LONG["max_new_tokens"], (generated, received)
        tries.append(generated - len(received))
    return tries


def test_disconnect_mid_stream_frees_the_slot(server):
    """A stream whose client goes away gives its slot back long before it would have ended by
    itself: its 'done' line counts the tokens it generated, a few past those read (one step
    an iteration on this server), far from its max_new_tokens."""
    tries = tokens_past_leaving(server, 2)
    assert min(tries) <= 3, tries
    assert slots_in_use(server) == 0


def test_disconnect_stops_decoding_within_a_step(server):
    """A stream whose client goes away decodes at most one step after TorchServe notices:
    the client reads 10 tokens and closes; the 11th is under way, a 12th may start before
    the close reaches TorchServe, and one more starts before the worker hears (steps overlap
    TorchServe's round trip). The request's 'done' line counts its tokens. (A server that
    ran several steps per iteration would decode that many more.)"""
    tries = tokens_past_leaving(server, 10)
    assert min(tries) <= 3, tries


@pytest.mark.parametrize("where", ["preprocess", "answer"])
def test_a_failure_reading_or_answering_costs_that_request_only(server, demo_llama, where):
    """A bug while reading a request or formatting its answer (injected: tests/injected.py, a
    BaseException as a Rust panic is) costs that request a 500; the requests decoding
    meanwhile and those sent with it are answered as usual, no slot stays taken, and the
    workers are the same processes."""
    running = server.post(LONG | {"max_new_tokens": 40, "stream": True}, stream=True)
    lines = running.iter_lines()
    first = json.loads(next(lines))["text"]  # it is decoding
    bad = {"prompt": f"Once upon a time {FAULT.format(where)}", "max_new_tokens": 8, "temperature": 0}
    good = {"prompt": "Once upon a time", "max_new_tokens": 8, "temperature": 0}
    with ThreadPoolExecutor(2) as pool:
        bad_r, good_r = pool.map(server.post, [bad, good])
    assert bad_r.status_code == 500, bad_r.text
    req_id = internal_error_id(bad_r.json()["message"])  # no exception text: the log has it, under that id
    assert server.logged(f"cannot {'read' if where == 'preprocess' else 'answer'} request {req_id}")
    assert good_r.json() == demo_llama.text_completion([good["prompt"]], 8, temperature=0)[0]
    rest = "".join(json.loads(line).get("text", "") for line in lines if line)
    assert first + rest == demo_llama.text_completion([LONG["prompt"]], 40, temperature=0)[0]["generation"]
    assert slots_in_use(server) == 0
    assert server.worker_pids() == server.initial_pids


def test_a_failure_in_a_decode_step_costs_that_step_only(server, demo_llama):
    """A decode step that raises (injected, at the request's 32nd token) fails the requests in
    that step, which is one batch: the running streams end with an error line, the one that
    caused it too (an OpenAI stream with an error event, then [DONE]). A request of three
    prompts that waited for slots meanwhile (all four taken by the streams, so that none of
    its prompts can be in the failed step) is answered as usual, the slots all come back, and
    the workers are the same processes."""
    bad = {"prompt": f"Once upon a time {FAULT.format('decode')}", "max_new_tokens": 60, "temperature": 0}
    openai_long = {"prompt": LONG["prompt"], "max_tokens": 150, "temperature": 0, "stream": True}
    openai_stream = server.post(openai_long, "/1.0/v1/completions", stream=True).iter_lines()
    streams = [server.post(body | {"stream": True}, stream=True).iter_lines()
               for body in (LONG | {"max_new_tokens": 150}, LONG | {"max_new_tokens": 140}, bad)]
    for lines in streams + [openai_stream]:
        next(lines)  # the four slots decoding, bad among them
    failed_steps = server.log().count("engine step failed")
    waiting = {"prompt": ["The sea", "A cat", "My dog"], "max_new_tokens": 8, "temperature": 0}
    waited = server.post(waiting)  # waits in the handler for three slots, which the failure frees
    ids = []
    for lines in streams:  # begun, so a 200 whose last line is the error
        last = [json.loads(line) for line in lines if line][-1]
        assert last["code"] == 500, last
        ids.append(internal_error_id(last["message"]))
    tail = [line for line in openai_stream if line]
    *_, error, done = tail  # OpenAI's: an error event, then [DONE]
    assert done == b"data: [DONE]", done
    error = json.loads(error.removeprefix(b"data: "))["error"]
    assert error["code"] == 500 and error["type"] == "server_error"
    ids.append(internal_error_id(error["message"]))
    assert waited.status_code == 200, waited.text
    assert waited.json() == demo_llama.text_completion(waiting["prompt"], 8, temperature=0)
    deadline = time.time() + 10  # each rank logs the failure once (the log reaches the file a little later)
    while server.log().count("engine step failed") < failed_steps + 2 and time.time() < deadline:
        time.sleep(0.2)
    assert server.log().count("engine step failed") == failed_steps + 2
    failure = [line for line in server.log().splitlines() if "engine step failed" in line][-1]
    assert all(req_id in failure for req_id in ids), (failure, ids)  # the ids the answers name
    assert slots_in_use(server) == 0
    assert server.worker_pids() == server.initial_pids


def internal_error_id(message: str) -> str:
    """The request id a 500's message names; it says nothing of the exception."""
    found = re.fullmatch(r"internal error; the server's log has the details under request id (\S+)", message)
    assert found, message
    return found.group(1)


@pytest.mark.parametrize("n_prompts", [4])
def test_request_with_more_prompts_waits_for_slots(server, demo_llama, n_prompts):
    """Three requests of four prompts each, at once, on four slots: the later ones wait for
    slots and every answer is the in-process model's."""
    bodies = [{"prompt": [f"{k} {i}" for i in range(n_prompts)], "max_new_tokens": 8, "temperature": 0}
              for k in ("apple", "pear", "plum")]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(server.generate, bodies))
    assert answers == [demo_llama.text_completion(b["prompt"], 8, temperature=0) for b in bodies]
