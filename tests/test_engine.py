"""The serving engine: the block pool and prefix hashes (kv_cache.py), the scheduler's
budget, admission and preemption (scheduler.py), and the engine's outputs (engine.py):
greedy tokens identical with prefix caching on and off, with chunks of 16 and 64 tokens
and whole prompts, with sequences joining and leaving, at TP 1 and 2 (where the ranks'
decisions, block tables included, agree), when blocks run out, and compiled."""

import os

import pytest
import torch

import llama2
from conftest import DEMO, TOKENIZER
from engine import Engine
from engine_worker import CONFIGS, N_NEW, SYSTEM, workload
from kv_cache import BlockPool, BlockTable, block_hash
from scheduler import Scheduler
from sequence import SamplingParams
from torchrun import run


def demo(max_seq_len: int = 256, **kwargs):
    return llama2.tp_llama(None, DEMO, None, 1, max_batch_size=4, max_seq_len=max_seq_len, **kwargs)


# --- kv_cache.py -----------------------------------------------------------------------------

def test_block_pool_reuses_least_recently_freed_and_keeps_hashes():
    pool = BlockPool(4, 2)
    a, b = BlockTable(pool), BlockTable(pool)
    assert a.grow(4) and a.blocks == [0, 1] and pool.num_free == 2
    a.commit([1, 2, 3, 4], 4)  # two full blocks, named by their tokens and their parent
    assert a.hashes == [block_hash(b"", [1, 2]), block_hash(block_hash(b"", [1, 2]), [3, 4])]
    assert not b.grow(6) and b.blocks == []  # all or nothing
    a.free()  # freed last block first: [1, 2]'s block is evicted last
    assert list(pool.free) == [2, 3, 1, 0]
    c = BlockTable(pool)
    assert c.match_prefix([1, 2, 3, 4, 5], 4) == 4 and c.blocks == [0, 1]  # found by hash, held again
    assert pool.ref[0] == pool.ref[1] == 1 and pool.num_free == 2
    d = BlockTable(pool)
    assert d.match_prefix([1, 2, 9, 9], 4) == 2  # shares the first block only
    assert pool.ref[0] == 2
    c.free()
    d.free()
    e = BlockTable(pool)
    assert e.grow(8) and pool.num_free == 0  # takes every block: the cached ones forget their hashes
    assert pool.cached == {} and e.blocks == [2, 3, 1, 0]
    e.free()
    assert BlockTable(pool).match_prefix([1, 2, 3, 4], 4) == 0


def test_block_pool_without_caching_finds_nothing():
    pool = BlockPool(4, 2, caching=False)
    a = BlockTable(pool)
    a.grow(4)
    a.commit([1, 2, 3, 4], 4)
    a.free()
    assert BlockTable(pool).match_prefix([1, 2, 3, 4], 4) == 0 and pool.cached == {}


class FakeSeq:
    def __init__(self, id, prompt, generated=0):
        self.id, self.prompt_tokens, self.tokens = id, list(prompt), [0] * generated
        self.needs_prompt_logprobs = False
        self.draft_room = 0  # no speculative decoding
        self.ahead = 0  # no asynchronous scheduling


def test_scheduler_budget_decodes_first_and_chunks():
    pool = BlockPool(64, 4)
    sched = Scheduler(pool, max_seqs=3, max_batched_tokens=10)
    long, short = FakeSeq(0, range(100, 125)), FakeSeq(1, range(200, 203))
    sched.add(long)
    sched.add(short)
    work = sched.schedule()
    assert [(w.seq.id, w.n) for w in work] == [(0, 10)]  # a chunk of the long prompt fills the budget
    long.cached += 10
    work = sched.schedule()
    assert [(w.seq.id, w.n) for w in work] == [(0, 10)]  # the running sequence goes on first
    long.cached += 10
    work = sched.schedule()
    assert [(w.seq.id, w.n) for w in work] == [(0, 5), (1, 3)]  # its last chunk, then the next prompt
    long.cached += 5
    short.cached += 3
    long.tokens.append(7)
    short.tokens.append(8)
    for s in (FakeSeq(2, range(9)), FakeSeq(3, range(9))):
        sched.add(s)
    work = sched.schedule()
    # the two decoding sequences first, then a chunk of the next prompt; a fourth sequence waits (max_seqs)
    assert [(w.seq.id, w.n) for w in work] == [(0, 1), (1, 1), (2, 8)]
    assert [s.id for s in sched.waiting] == [3]


def test_scheduler_preempts_the_newest_when_blocks_run_out():
    pool = BlockPool(4, 2)
    sched = Scheduler(pool, max_seqs=4)
    old, new = FakeSeq(0, [1, 2, 3]), FakeSeq(1, [4, 5, 6])
    sched.add(old)
    sched.add(new)
    assert [(w.seq.id, w.n) for w in sched.schedule()] == [(0, 3), (1, 3)]  # 2 blocks each
    for s in (old, new):
        s.cached = 3
        s.tokens.append(9)
    work = sched.schedule()  # both fit their 4th token in their 2nd block
    for s in (old, new):
        s.cached = 4
        s.tokens.append(9)
    work = sched.schedule()  # the 5th token needs a 3rd block: the newest gives its blocks
    assert [(w.seq.id, w.n) for w in work] == [(0, 1)] and sched.preemptions == 1
    assert list(sched.waiting) == [new] and new.cached == 0 and new.table.blocks == []


def test_a_sequence_preempted_after_its_turn_gets_no_work():
    """The newest sequence decodes, then an older one that took two tokens at once (as a
    draft would) needs a block: the newest is preempted, and its token, scheduled already,
    is dropped from the step. (The engine's own steps never get here: prompts hold their
    blocks from admission, decodes go oldest first, and the victim is the newest.)"""
    pool = BlockPool(4, 2)
    sched = Scheduler(pool, max_seqs=2)
    old, new = FakeSeq(0, [1, 2, 3]), FakeSeq(1, [4, 5])
    sched.add(old)
    sched.add(new)
    assert [(w.seq.id, w.n) for w in sched.schedule()] == [(0, 3), (1, 2)]  # 3 of the 4 blocks
    old.cached, new.cached = 3, 2
    old.tokens += [7, 8]
    new.tokens.append(9)
    work = sched.schedule()  # new takes the last block for its token, old needs one more
    assert [(w.seq.id, w.n) for w in work] == [(0, 2)] and sched.preemptions == 1
    assert list(sched.waiting) == [new] and new.cached == 0 and new.table.blocks == []


# --- engine.py --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def results():
    llama = demo()
    return {config: workload(llama, *config) for config in CONFIGS}


def test_greedy_tokens_identical_with_and_without_caching_and_chunks(results):
    reference = results[(False, 0)]["tokens"]  # no prefix caching, whole prompts
    for config, result in results.items():
        tokens = result["tokens"]
        # the sequence that left early has as many tokens as it had time for
        left = tokens[1]
        assert left == reference[1][:len(left)] or reference[1] == left[:len(reference[1])], config
        assert tokens[:1] + tokens[2:] == reference[:1] + reference[2:], config
        assert result["hits"] > 0 if config[0] else result["hits"] == 0
    assert reference[-1] == reference[0]  # the repeated prompt
    assert all(len(t) == N_NEW for t in reference[3:6]) and len(reference[1]) < N_NEW


def test_prefix_hit_computes_only_the_rest():
    llama = demo()
    engine = Engine(llama.runner, llama.tokenizer, max_seqs=4)
    computed = []
    real = llama.runner.forward_batch
    llama.runner.forward_batch = lambda batch: computed.append(len(batch.tokens)) or real(batch)
    tok, params = llama.tokenizer, SamplingParams(max_gen_len=4, temperature=0)
    prompts = [tok.encode(SYSTEM + q, bos=True, eos=False) for q in ("Hi?", "Who are you?")]
    first = engine.add(prompts[0], params)
    while engine.running:
        engine.step()
    computed.clear()
    second = engine.add(prompts[1], params)
    engine.step()
    shared = len(os.path.commonprefix([prompts[0], prompts[1]]))
    cached = shared // engine.pool.block_size * engine.pool.block_size
    assert cached >= 16 and computed == [len(prompts[1]) - cached]
    again = engine.add(prompts[0], params)  # cached: its full blocks but the one with its last token
    engine.step()
    size = engine.pool.block_size
    assert computed[-1] == 1 + len(prompts[0]) - (len(prompts[0]) - 1) // size * size  # + the second's next token
    while engine.running:
        engine.step()
    assert again.tokens == first.tokens
    alone = Engine(llama.runner, tok, prefix_caching=False)
    s = alone.add(prompts[1], params)
    while alone.running:
        alone.step()
    assert second.tokens == s.tokens


@pytest.mark.parametrize("threaded", [True, False])
def test_steps_started_equal_the_callers(threaded):
    """start(run) runs on the engine's own thread, not the caller's, or with threaded=False
    (a server whose steps run in turn with its own work) at once on the caller's, before
    start() returns; the tokens are those of steps run in the caller's thread; wait() gives
    the result, or raises a step's exception, once; a second start before wait() is refused."""
    import threading

    llama = demo()
    tok, params = llama.tokenizer, SamplingParams(max_gen_len=8, temperature=0)
    prompt = tok.encode("Once upon a time", bos=True, eos=False)
    inline = Engine(llama.runner, tok)
    expected = inline.add(prompt, params)
    while inline.running:
        inline.step()
    engine = Engine(llama.runner, tok, threaded=threaded)
    seq, threads, runs = engine.add(prompt, params), set(), []
    while engine.running:
        before = len(runs)
        engine.start(lambda: threads.add(threading.current_thread()) or runs.append(engine.run(3)) or runs[-1])
        assert threaded or len(runs) == before + 1  # without a thread, done already
        with pytest.raises(AssertionError, match="wait"):
            engine.start(engine.run, 1)
        assert engine.wait() == runs[-1] >= 1
    here = threading.current_thread() in threads
    assert seq.tokens == expected.tokens and len(threads) == 1 and here != threaded
    assert engine.wait() is None  # nothing started

    engine.add(prompt, params)
    llama.runner.forward_batch = lambda batch: 1 / 0
    engine.start(engine.step)
    with pytest.raises(ZeroDivisionError):
        engine.wait()
    assert engine.wait() is None


def test_blocks_running_out_preempt_and_recompute():
    """A pool of 9 blocks of 16 tokens for four sequences of 33-44 tokens: some are
    preempted and recomputed, none fails, and every one gets the tokens it gets alone."""
    llama = demo(max_seq_len=128)
    llama.runner.allocate(num_blocks=9)
    tok = llama.tokenizer
    prompts = [tok.encode(f"Story {i}: " + "once upon a time " * (2 + i), bos=True, eos=False) for i in range(4)]
    params = SamplingParams(max_gen_len=24, temperature=0)
    alone = []
    for p in prompts:
        engine = Engine(llama.runner, tok, prefix_caching=False)
        seq = engine.add(p, params)
        while engine.running:
            engine.step()
        alone.append(seq.tokens)
    engine = Engine(llama.runner, tok, max_seqs=4, prefix_caching=False)
    seqs = [engine.add(p, params) for p in prompts]
    while engine.running:
        engine.step()
    assert engine.scheduler.preemptions > 0
    assert [s.tokens for s in seqs] == alone
    assert engine.pool.num_used == 0


def test_run_takes_the_steps_that_fit_in_its_time():
    """run(max_steps, seconds, min_steps) takes as many steps as fit in seconds at the last
    run's pace, at least min_steps (1) and at most max_steps; it still ends at a first token."""
    llama = demo()
    engine = Engine(llama.runner, llama.tokenizer)
    engine.add(llama.tokenizer.encode("Once upon a time", bos=True, eos=False),
               SamplingParams(max_gen_len=64, temperature=0, ignore_eos=True))
    assert engine.run(16, seconds=60) == 1  # the prefill gives the first token; no pace yet
    assert engine.run(16, seconds=60) == 16 and engine.pace > 0
    assert engine.run(16, seconds=engine.pace * 3.5) == 3
    assert engine.run(16, seconds=1e-9) == 1
    assert engine.run(16, seconds=1e-9, min_steps=4) == 4



def test_a_run_ends_after_a_step_that_chunks_a_prompt_beside_streams():
    """A long prompt's chunks make long steps: a run without a time budget ends after each
    one that also gave the decoding sequences their tokens, so that they go out at once; with
    one, it goes on with the steps that fit in the time left, measured by that step (none
    when it is up, whatever min_steps said); a long prompt alone, or decoding alone, runs on."""
    llama = demo()
    engine = Engine(llama.runner, llama.tokenizer, max_batched_tokens=16)
    params = SamplingParams(max_gen_len=64, temperature=0, ignore_eos=True)
    long_prompt = llama.tokenizer.encode(SYSTEM * 4, bos=True, eos=False)
    assert len(long_prompt) > 64
    engine.add(long_prompt, params)
    assert engine.run(16) == -(-len(long_prompt) // 16)  # alone: its chunks, up to its first token
    streams = [engine.add(llama.tokenizer.encode(q, bos=True, eos=False), params) for q in ("Hi", "Yes")]
    while not all(s.tokens for s in streams):
        engine.step()
    assert engine.run(16) == 16  # decoding alone
    engine.add(long_prompt[::-1], params)
    assert engine.run(16) == 1 and engine.long_step  # a chunk beside the streams' tokens
    tokens = [len(s.tokens) for s in streams]
    assert engine.run(16) == 1 and [len(s.tokens) for s in streams] == [t + 1 for t in tokens]
    assert engine.run(16, seconds=1e-9, min_steps=4) == 1 and engine.long_step  # the time is up
    assert engine.run(4, seconds=1000.0, min_steps=4) == 4 and engine.long_step  # all fit


@pytest.mark.slow
def test_tp2_ranks_decide_alike_and_match_tp1(results, tmp_path):
    """At TP=2 the ranks' schedulers decide alike and give TP=1's tokens; in run(16, seconds),
    with one rank's steps slower than the other's, both take rank 0's count of steps."""
    ranks = run("engine_worker.py", 2, tmp_path, DEMO)
    budgeted = [r["budgeted"] for r in ranks]
    assert budgeted[0]["runs"] == budgeted[1]["runs"] and max(budgeted[0]["runs"]) > 1, budgeted[0]["runs"]
    assert all(b["tokens"] == b["plain"] == budgeted[0]["plain"] for b in budgeted)
    for config in CONFIGS:
        assert ranks[0][config]["digest"] == ranks[1][config]["digest"], config
        for rank in ranks:
            assert rank[config]["tokens"] == results[config]["tokens"], config
            assert rank[config]["hits"] == results[config]["hits"]


@pytest.mark.slow  # torch.compile
def test_compiled_engine_never_recompiles(checkpoints, monkeypatch):
    """compile_decode's graphs serve the engine's decode steps, whatever the number of
    sequences and blocks; prefill chunks run eager. Outputs equal the eager engine's. With
    inductor's C++ wrapper, as the server compiles them (loading.py). The KV cache holds one
    max_seq_len and a half: its first step of several rows compiled in the engine."""
    # a 2-layer model (the demo's tokenizer): dynamo traces every layer of each graph, and
    # the graphs' kinds and shapes do not depend on the depth
    llama = llama2.tp_llama(None, checkpoints["gqa"][1]["hf"], TOKENIZER, 1, max_batch_size=4, max_seq_len=256)
    llama.runner.allocate(num_blocks=llama.runner.row_blocks * 3 // 2)
    eager = workload(llama, True, 16)
    asked, real_compile = [], torch.compile
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: asked.append(kwargs) or real_compile(*args, **kwargs))
    llama.runner.compile_decode(cpp_wrapper=True)
    assert asked[0]["options"] == {"cpp_wrapper": True}
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = workload(llama, True, 16)
    assert compiled["tokens"] == eager["tokens"]
