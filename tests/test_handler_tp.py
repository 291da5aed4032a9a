"""The handler at TP=2 follows rank 0's batches, not TorchServe's copies: TorchServe 0.12
may send a rank other than 0 the next batch instead of the current one, or none
(handler.py's docstring). tests/handler_worker.py serves a few requests arriving over
several iterations as TorchServe's backend would, giving rank 1 other batches, in turn
and with overlapped steps, in a Python with the runtime requirements alone."""

import json

import pytest

from conftest import DEMO
from handler_worker import DECODED, REQUESTS
from torchrun import run

pytestmark = pytest.mark.slow  # torchrun ranks


@pytest.mark.parametrize("overlap", [False, True])
def test_the_ranks_follow_rank_0s_batches(tmp_path, demo_llama, overlap):
    ranks = run("handler_worker.py", 2, tmp_path, "true" if overlap else "false", DEMO, timeout=240,
                runtime_only=True)
    answers = ranks[0]["answers"]
    bodies = {rid: body for _, rid, _, body in REQUESTS}

    def reference(rid, n):
        prompt = bodies[rid]["prompt"]
        return [a["generation"] for a in demo_llama.text_completion(prompt if isinstance(prompt, list) else [prompt],
                                                                  n, temperature=0)]

    streamed = [json.loads(line) for message in answers["stream"] for line in message.splitlines()]
    assert "".join(m.get("text", "") for m in streamed) == reference("stream", 24)[0]
    assert [c["generation"] for c in json.loads(answers["two"][0])] == reference("two", 12)
    events = [json.loads(line[6:]) for message in answers["openai"] for line in message.splitlines()
              if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == reference("openai", 10)[0]
    assert json.loads(answers["tokenize"][0])["tokens"] == demo_llama.tokenizer.encode("hello", bos=True, eos=False)
    assert "max_new_tokens" in json.loads(answers["refused"][0])["message"]
    # rank 1 decoded the same tokens for the same requests, and scheduled as rank 0 did
    assert sorted(ranks[0]["finished"]) == sorted(ranks[1]["finished"]) == sorted(DECODED)
    assert ranks[1]["finished"] == ranks[0]["finished"]
    assert ranks[1]["digest"] == ranks[0]["digest"]


def test_rank_0_renders_for_every_rank(tmp_path, llama3):
    """A chat template that prints the date (Llama 3.1's "Today Date") renders what rank 0's
    clock says on every rank: rank 1's clock is a day ahead (across midnight), and its own
    rendering differs, yet both ranks run rank 0's token ids and decode the same tokens."""
    folder = llama3["scaled16"][1]["hf"]
    ranks = run("handler_worker.py", 2, tmp_path, "false", folder, "dated", timeout=240, runtime_only=True)
    assert ranks[0]["own_render"] != ranks[1]["own_render"]  # the clocks render differently
    for rid in ("chat", "openai-chat"):
        [(prompt, tokens)] = ranks[0]["finished"][rid]
        assert prompt == ranks[0]["own_render"] and tokens
    assert ranks[1]["finished"] == ranks[0]["finished"]
    assert ranks[1]["digest"] == ranks[0]["digest"]
    answers = ranks[0]["answers"]
    native = json.loads(answers["chat"][0])["generation"]["content"]
    assert native == json.loads(answers["openai-chat"][0])["choices"][0]["message"]["content"]
