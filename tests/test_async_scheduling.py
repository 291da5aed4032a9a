"""Asynchronous scheduling (engine.py): a step starts while the tokens of the step before are
still on the device, and the host appends them (text, stop strings, ends) after. It gives the
synchronous loop's tokens, texts, finish reasons and logprobs: greedy and seeded, with stop
strings, stop ids, max_gen_len, prefix caching, chunked prefill, preemption and requests
whose steps must wait for their tokens on the host, at TP 1 and 2."""

import pytest

import llama2
from conftest import DEMO, TOKENIZER
from engine import Engine
from engine_worker import ASYNC_CONFIGS, mixed, workload
from generate import generate
from sequence import SamplingParams
from torchrun import run

LEFT = 1  # workload()'s sequence that leaves mid-way


@pytest.fixture(scope="module")
def llama():
    return llama2.tp_llama(None, DEMO, None, 1, max_batch_size=4, max_seq_len=256)


@pytest.fixture(scope="module")
def synchronous(llama):
    """TP 1's results without asynchronous scheduling: the reference."""
    return {config: workload(llama, *config) for config in ASYNC_CONFIGS} | {"mixed": mixed(llama, False)}


def assert_same_workload(result: dict, reference: dict):
    """The same tokens, but for the sequence that leaves mid-way: released between steps, it
    lacks a token still on the device when it left, if any."""
    tokens, expected = result["tokens"], reference["tokens"]
    assert tokens[:LEFT] + tokens[LEFT + 1:] == expected[:LEFT] + expected[LEFT + 1:]
    assert expected[LEFT][:len(tokens[LEFT])] == tokens[LEFT] and len(tokens[LEFT]) >= len(expected[LEFT]) - 1
    assert result["hits"] == reference["hits"]


def assert_same_mixed(result: dict, reference: dict):
    for key in ("tokens", "texts", "finish_reasons"):
        assert result[key] == reference[key], key
    # as many logprobs, alike to 1e-5: a step that computes a row for a sequence that has
    # just ended is a batch of another size, and float sums differ in the last bits
    assert [len(values) for values in result["logprobs"]] == [len(values) for values in reference["logprobs"]]
    assert all(abs(a - b) < 1e-5 for values, expected in zip(result["logprobs"], reference["logprobs"])
               for a, b in zip(values, expected))
    assert sum(result["carried"]) > 0 and not any(reference["carried"])  # it did run ahead, the reference never
    assert result["carried"].count(0) > 1  # and some steps waited (prefills, the requests that must)


@pytest.mark.parametrize("config", ASYNC_CONFIGS)
def test_greedy_tokens_equal_the_synchronous_loops(llama, synchronous, config):
    assert_same_workload(workload(llama, *config, async_scheduling=True), synchronous[config])


def test_mixed_requests_equal_the_synchronous_loops(llama, synchronous):
    """Seeded draws, stop strings and ids, max_gen_len, penalties, logprobs, min_tokens and
    logit_bias, preempted on a small pool: the same tokens, texts, ends and logprobs."""
    reference = synchronous["mixed"]
    assert reference["preemptions"] > 0 and len(set(reference["finish_reasons"])) == 2
    assert_same_mixed(mixed(llama, True), reference)


def test_an_engine_refuses_async_scheduling_with_speculation(llama):
    """Proposals come from the tokens on the host, which a step that ran ahead lacks."""
    from speculative import NgramProposer, Speculation

    with pytest.raises(ValueError, match="asynchronous scheduling cannot run with speculation"):
        Engine(llama.runner, llama.tokenizer, speculation=Speculation(NgramProposer(), 4, 2, 256),
               async_scheduling=True, threaded=False)


def test_runs_of_one_step_run_ahead_and_never_compute_past_the_end(llama):
    """run(1), a server's iteration on a GPU, leaves the step's tokens on the device, and the
    next run's step reads them there; the text lags a step, then is whole. A sequence whose
    last token (max_gen_len) is still on the device gets no step of its own: the positions it
    computes stay within prompt + max_gen_len (the KV cache's bound)."""
    tok = llama.tokenizer
    prompt = tok.encode("Once upon a time", bos=True, eos=False)
    params = SamplingParams(max_gen_len=5, temperature=0, ignore_eos=True)
    engine = Engine(llama.runner, tok, async_scheduling=True)
    passes, forward = [], llama.runner.forward_batch
    llama.runner.forward_batch = lambda batch: passes.append((batch.positions, len(batch.carried))) or forward(batch)
    try:
        seq, lengths = engine.add(prompt, params), []
        while engine.running:
            engine.run(1)
            lengths.append(len(seq.tokens))
    finally:
        llama.runner.forward_batch = forward
    assert seq.tokens == generate(llama, [prompt], 5, temperature=0, ignore_eos=True)[0][0]
    assert seq.finish_reason == "length"
    assert [carried for _, carried in passes] == [0, 1, 1, 1, 1]  # the prefill, then 4 decodes
    assert max(passes[-1][0]) == len(prompt) + 3 and lengths == [0, 1, 2, 3, 4, 5]
    assert engine.pool.num_used == 0


@pytest.mark.slow
def test_tp2_ranks_agree_and_give_tp1s_tokens(synchronous, tmp_path):
    ranks = run("engine_worker.py", 2, tmp_path, DEMO, "async")
    for key in ASYNC_CONFIGS + ["mixed"]:
        assert ranks[0][key]["digest"] == ranks[1][key]["digest"], key
    for rank in ranks:
        for config in ASYNC_CONFIGS:
            assert_same_workload(rank[config], synchronous[config])
        assert_same_mixed(rank["mixed"], synchronous["mixed"])


@pytest.mark.slow  # torch.compile
def test_carried_tokens_reach_the_cuda_graph_steps(checkpoints):
    """The padded decode steps that CUDA graphs replay (compile_decode(cuda_graphs=True), run
    compiled on the CPU) take the carried tokens too: the same tokens as without."""
    import torch

    # a 2-layer model (the demo's tokenizer): dynamo traces every layer of each graph
    graphs = llama2.tp_llama(None, checkpoints["gqa"][1]["hf"], TOKENIZER, 1, max_batch_size=4, max_seq_len=256)
    try:
        graphs.runner.compile_decode(cuda_graphs=True)
        for config in ASYNC_CONFIGS:
            assert_same_workload(workload(graphs, *config, async_scheduling=True), workload(graphs, *config))
    finally:
        # the next tests' models compile anew: flex_attention compiled again for another
        # model's shapes after these graphs failed in inductor's CPU template (torch 2.13)
        torch._dynamo.reset()
