"""Preemption and shared blocks in the serving engine: a pool too small for its sequences
preempts some and recomputes them, and they answer as with a pool that holds them all:
prompt logprobs (echo) once each, the same tokens and token logprobs; and sequences that
fill blocks of one prefix at once give the tokens each gives alone."""

import pytest

import llama2
from conftest import DEMO
from engine import Engine
from engine_worker import QUESTIONS, SYSTEM
from sequence import SamplingParams

MAX_SEQ_LEN = 64  # 4 blocks of 16 tokens a sequence: a pool of 4 blocks still takes any one


@pytest.fixture(scope="module")
def llama():
    return llama2.tp_llama(None, DEMO, None, 1, max_batch_size=4, max_seq_len=MAX_SEQ_LEN)


def run(llama, num_blocks: int | None, prompts: list[list[int]], params: list[SamplingParams],
        **engine_options) -> tuple[Engine, list, list[tuple]]:
    """The prompts run to the end on a pool of num_blocks (None: the runner's, room for
    max_batch_size sequences of max_seq_len). Returns the engine, the sequences, and for
    each preemption the victim's (id, prompt tokens scored, tokens generated) then."""
    runner, whole = llama.runner, llama.runner.num_blocks
    # the engine hands out the cache's first num_blocks; the cache keeps its shape, for which
    # FlexAttention's kernels are compiled (test_attention.py's runs with flex)
    runner.num_blocks = num_blocks or whole
    try:
        engine = Engine(runner, llama.tokenizer, max_seqs=4, **engine_options)
    finally:
        runner.num_blocks = whole
    victims, preempt = [], engine.scheduler.preempt

    def record(seq):
        victims.append((seq.id, len(seq.prompt_logprobs), len(seq.tokens)))
        preempt(seq)

    engine.scheduler.preempt = record
    seqs = [engine.add(p, q) for p, q in zip(prompts, params)]
    while engine.running:
        engine.step()
    assert engine.pool.num_used == 0
    return engine, seqs, victims


def assert_same_scores(values, tops, expected_values, expected_tops):
    """Logprobs and top logprobs alike: as many, the same top tokens, values to 1e-4 (the
    batches differ, a recomputed sequence's keys come from a prefill instead of decodes, and
    float sums differ with them in the last bits)."""
    assert len(values) == len(expected_values) and len(tops) == len(expected_tops)
    assert values == pytest.approx(expected_values, abs=1e-4)
    assert [[i for i, _ in t] for t in tops] == [[i for i, _ in t] for t in expected_tops]
    assert [v for t in tops for _, v in t] == pytest.approx([v for t in expected_tops for _, v in t], abs=1e-4)


@pytest.mark.parametrize("temperature", [0, 0.8], ids=["greedy", "seeded"])
def test_preempted_sequences_answer_as_unpreempted(llama, temperature):
    """Three sequences with logprobs, echo and top logprobs on 4 blocks, prompts in chunks
    of 8 tokens: the long one is preempted while its prompt is partly scored, and again after
    its first tokens. Each gets one logprob per prompt token, and the prompt logprobs,
    tokens and token logprobs of the default pool, where none is preempted."""
    tok = llama.tokenizer
    text = "once upon a time there was a little llama who lived in the hills " * 3
    prompts = [tok.encode(text, bos=True, eos=False)[:n] for n in (12, 10, 30)]
    params = [SamplingParams(max_gen_len=n, temperature=temperature, seed=i, logprobs=True, top_logprobs=2, echo=True,
                             ignore_eos=True) for i, n in enumerate((24, 10, 4))]
    small, preempted, victims = run(llama, 4, prompts, params, max_batched_tokens=8)
    default, expected, _ = run(llama, None, prompts, params, max_batched_tokens=8)
    assert default.scheduler.preemptions == 0 and small.scheduler.preemptions == len(victims) >= 2
    assert any(0 < scored < len(prompts[i]) for i, scored, _ in victims)  # preempted mid-prompt
    assert any(generated > 0 for _, _, generated in victims)  # preempted while decoding
    for seq, want in zip(preempted, expected):
        assert len(seq.prompt_logprobs) == len(seq.prompt_tokens)
        assert_same_scores(seq.prompt_logprobs, seq.prompt_top_logprobs, want.prompt_logprobs,
                           want.prompt_top_logprobs)
        assert seq.tokens == want.tokens and len(seq.tokens) == seq.params.max_gen_len
        assert_same_scores(seq.logprobs, seq.top_logprobs, want.logprobs, want.top_logprobs)


def test_sequences_filling_blocks_of_one_prefix_at_once_answer_as_alone(llama):
    """Two copies of a prompt fill its first block at once, each its own copy: the first
    one's is registered, the other's stays unnamed. A prompt with the same first block, added
    then, computes only its rest, while the copies decode. Every sequence gets the tokens it
    gets alone."""
    llama.runner.allocate()
    tok = llama.tokenizer
    prompts = [tok.encode(SYSTEM + q, bos=True, eos=False) for q in QUESTIONS[:2]]
    params = SamplingParams(max_gen_len=8, temperature=0)
    alone = [run(llama, None, [p], [params], prefix_caching=False)[1][0].tokens for p in prompts]
    engine = Engine(llama.runner, tok, max_seqs=4)
    a, b = engine.add(prompts[0], params), engine.add(prompts[0], params)
    engine.step()
    assert a.table.hashes[0] == b.table.hashes[0] and a.table.blocks[0] != b.table.blocks[0]
    assert engine.pool.cached[a.table.hashes[0]] == a.table.blocks[0] and engine.pool.hash[b.table.blocks[0]] is None
    c = engine.add(prompts[1], params)
    while engine.running:
        engine.step()
    size = engine.pool.block_size
    assert engine.pool.hits == size and engine.pool.num_used == 0  # c found the first block
    named = [h for h in engine.pool.hash if h is not None]
    assert len(named) == len(set(named)) == len(engine.pool.cached)  # one block for each hash
    assert [a.tokens, b.tokens, c.tokens] == [alone[0], alone[0], alone[1]]
