"""The engine workload of test_engine.py, in-process or as one tensor-parallel rank started by
tests/torchrun.py:

    engine_worker.py OUT_DIR FOLDER [constrained | speculative | flex | async]

runs workload() on FOLDER (loaded with llama2.tp_llama on WORLD_SIZE ranks) once per entry
of CONFIGS and saves {config: result} to OUT_DIR/rank{r}.pt; with constrained, runs
constrained() (test_constrained.py's) alone and saves {"constrained": result}; with
speculative, test_speculative.py's speculated() for each proposer, {method: result}; with
flex, workload() for each of FLEX_CONFIGS and preempted() with FlexAttention (test_attention.py);
with async, workload() for each of ASYNC_CONFIGS and mixed(), with asynchronous scheduling."""

import os
import sys

import torch
import torch.distributed as dist

import structured
from engine import Engine
from sequence import SamplingParams
from speculative import DraftProposer, NgramProposer, Speculation
from structured import Constraint

SYSTEM = "You are a cheerful assistant. You answer every question briefly, kindly and with a joke. "
QUESTIONS = ["What is the sea?", "Why is the sky blue?", "Tell me a story.", "Count to five."]
LONG = "A long prompt: " + " ".join(f"word{i}" for i in range(60))
N_NEW = 12
# (prefix caching, max_batched_tokens): chunks of 16 and 64 tokens, and whole prompts
CONFIGS = [(caching, budget) for caching in (True, False) for budget in (16, 64, 0)]
FLEX_CONFIGS = [(True, 16), (False, 64), (True, 0)]
# flex's runs on the pool of test_attention.py's other flex runs (its TorchServe's, 4 slots of
# 512): inductor specialises flex's kernels on the pool, and its cache serves that server
FLEX_MAX_SEQ_LEN = 512


def workload(llama, caching: bool, budget: int, max_seqs: int = 4, **options) -> dict:
    """Sequences that share a system prompt, join at different steps, one leaving early,
    more of them than max_seqs, a long prompt, and a repeat of a whole prompt. Returns
    each sequence's tokens (in the order added), the scheduler's digest of its decisions,
    and the prefix-cache counts. options: more of Engine's."""
    engine = Engine(llama.runner, llama.tokenizer, max_seqs=max_seqs, max_batched_tokens=budget,
                    prefix_caching=caching, **options)
    tok = llama.tokenizer
    prompts = [tok.encode(SYSTEM + q, bos=True, eos=False) for q in QUESTIONS] + \
        [tok.encode(LONG, bos=True, eos=False), tok.encode("Once upon a time", bos=True, eos=False)]
    params = SamplingParams(max_gen_len=N_NEW, temperature=0)
    seqs = [engine.add(prompts[0], params), engine.add(prompts[1], params)]
    for _ in range(3):
        engine.step()
    seqs.append(engine.add(prompts[2], params))
    engine.step()
    engine.release(seqs[1])  # leaves mid-way
    seqs += [engine.add(p, params) for p in prompts[3:]]
    while engine.running:
        engine.step()
    seqs.append(engine.add(prompts[0], params))  # all of it cached but its last token
    while engine.running:
        engine.step()
    assert engine.pool.num_used == 0
    return {"tokens": [s.tokens for s in seqs], "digest": engine.scheduler.digest.hexdigest(),
            "queries": engine.pool.queries, "hits": engine.pool.hits, "preemptions": engine.scheduler.preemptions}


CONSTRAINTS = [Constraint("json_schema", {"type": "object", "additionalProperties": False, "required": ["mood", "n"],
                                          "properties": {"mood": {"enum": ["happy", "sad"]},
                                                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}),
               Constraint("regex", r"[a-z]{1,8}@[a-z]{2,8}\.(com|org|net)"), Constraint("choice", ["yes", "no"]),
               Constraint("json_object"), None]


def constrained(llama) -> dict:
    """Sequences with each of CONSTRAINTS (and one without), greedy and seeded at temperature
    1, in chunks of 16 tokens, more of them than max_seqs. Returns each one's tokens, text and
    finish reason, and which are greedy."""
    engine = Engine(llama.runner, llama.tokenizer, max_seqs=4, max_batched_tokens=16)
    prompt = llama.tokenizer.encode(SYSTEM + "Answer:", bos=True, eos=False)
    settings = [(c, temperature) for c in CONSTRAINTS for temperature in (0.0, 1.0)]
    seqs = [engine.add(prompt, SamplingParams(max_gen_len=150, temperature=t, seed=7, constraint=c))
            for c, t in settings]
    while engine.running:
        engine.step()
    return {"tokens": [s.tokens for s in seqs], "texts": [s.text for s in seqs],
            "finish_reasons": [s.finish_reason for s in seqs], "greedy": [t == 0 for _, t in settings],
            "matchers": sum(s.matcher is not None for s in seqs), "compiled": len(structured.compiled.kept)}


PASSAGE = ("The old lighthouse keeper climbed the stairs every evening, lit the lamp, and watched the ships "
           "pass the rocks until morning came over the grey sea.")


def speculative_requests(tok) -> list[tuple[list[int], SamplingParams]]:
    """Prompts that quote a passage (prompt lookup finds what follows) and some that do not,
    greedy: one ended by a stop string and one by max_gen_len a few tokens in, where a run
    of accepted tokens may cross them, and one that opts out."""
    quote = tok.encode(f"{PASSAGE}\nOnce more, word for word: {PASSAGE[:60]}", bos=True, eos=False)
    prompts = [quote, tok.encode(SYSTEM + QUESTIONS[1], bos=True, eos=False), tok.encode(LONG, bos=True, eos=False),
               quote, quote, tok.encode(SYSTEM + QUESTIONS[0], bos=True, eos=False)]
    settings = [{}, {}, {}, {"stop": ("water, and",)}, {"max_gen_len": 33}, {"speculative": False}]
    return [(p, SamplingParams(**({"max_gen_len": 40, "temperature": 0} | s))) for p, s in zip(prompts, settings)]


def draft_model(folder: str, world_size: int):
    """A draft for the demo: the same checkpoint quantized to int8, which mostly agrees with it."""
    import llama2
    draft = llama2.tp_llama(None, folder, None, world_size, max_batch_size=4, max_seq_len=256, quantization="int8")
    return draft.runner


def speculated(llama, proposer, caching: bool = True, budget: int = 16, max_seqs: int = 3) -> dict:
    """speculative_requests() decoded with proposer (None: without speculation), with chunked
    prefill, more sequences than max_seqs; then the first again, from the prefix cache. Returns
    each one's tokens, text and finish reason, and the proposed and accepted counts."""
    spec = proposer and Speculation(proposer, 4, max_seqs, llama.runner.max_seq_len)
    engine = Engine(llama.runner, llama.tokenizer, max_seqs=max_seqs, max_batched_tokens=budget,
                    prefix_caching=caching, speculation=spec)
    requests = speculative_requests(llama.tokenizer)
    seqs = [engine.add(p, params) for p, params in requests]
    while engine.running:
        engine.step()
    seqs.append(engine.add(*requests[0]))
    while engine.running:
        engine.step()
    assert engine.pool.num_used == 0
    return {"tokens": [s.tokens for s in seqs], "texts": [s.text for s in seqs],
            "finish_reasons": [s.finish_reason for s in seqs], "hits": engine.pool.hits,
            "proposed": spec.proposed if spec else 0, "accepted": spec.accepted if spec else 0}


def preempted(llama) -> dict:
    """Three sequences (greedy, seeded, greedy) on a pool of 4 blocks of 16 tokens, prompts in
    chunks of 8 (test_preemption.py's run): their tokens, and each preemption's victim."""
    from test_preemption import run as run_on_pool

    tok = llama.tokenizer
    text = "once upon a time there was a little llama who lived in the hills " * 3
    prompts = [tok.encode(text, bos=True, eos=False)[:n] for n in (12, 10, 30)]
    params = [SamplingParams(max_gen_len=n, temperature=t, seed=i, ignore_eos=True)
              for i, (n, t) in enumerate(((24, 0), (10, 0.8), (4, 0)))]
    _, seqs, victims = run_on_pool(llama, 4, prompts, params, max_batched_tokens=8)
    return {"tokens": [s.tokens for s in seqs], "victims": victims}


ASYNC_CONFIGS = [(True, 16), (False, 0)]


def mixed(llama, async_scheduling: bool) -> dict:
    """Requests of the kinds a server mixes, decoded by run(4) as a server's iterations do,
    with a pool small enough to preempt: seeded draws at temperature 1; greedy ones ended by
    a stop string, a stop id and max_gen_len; and ones whose sampling reads their tokens on
    the host (penalties, logprobs, min_tokens), whose steps wait for them (and which end
    sooner, so that steps without them run ahead, whatever the draws). The stop string
    and id come from a greedy run of the first prompt. Returns each one's tokens, text,
    finish reason and logprobs, the preemptions, and how many rows each step carried on the
    device (asynchronous scheduling's)."""
    tok = llama.tokenizer
    prompts = [tok.encode(SYSTEM + q, bos=True, eos=False) for q in QUESTIONS]
    probe = Engine(llama.runner, tok)
    seq = probe.add(prompts[0], SamplingParams(max_gen_len=N_NEW, temperature=0, ignore_eos=True))
    while probe.running:
        probe.step()
    stop_text = seq.text[len(seq.text) // 2:][:3]
    settings = [dict(temperature=1.0, seed=1), dict(temperature=0, stop=(stop_text,)),
                dict(temperature=1.0, seed=2, top_k=20), dict(temperature=0, stop_token_ids=(seq.tokens[5],)),
                dict(temperature=0.8, seed=3, frequency_penalty=0.5, max_gen_len=N_NEW // 2),
                dict(temperature=0, max_gen_len=1), dict(temperature=1.0, seed=4, logprobs=True, top_logprobs=2,
                                                         max_gen_len=N_NEW // 2), dict(temperature=0, min_tokens=6),
                dict(temperature=1.0, seed=5, top_p=0.8, logit_bias={seq.tokens[2]: 3.0})]
    max_seq_len = llama.runner.max_seq_len
    llama.runner.allocate(max_seq_len=64, num_blocks=10)  # 4 blocks a sequence: 2 or 3 fit
    engine = Engine(llama.runner, tok, max_seqs=4, max_batched_tokens=32, async_scheduling=async_scheduling)
    carried, forward = [], llama.runner.forward_batch
    llama.runner.forward_batch = lambda batch: carried.append(len(batch.carried)) or forward(batch)
    try:
        seqs = [engine.add(prompts[i % len(prompts)], SamplingParams(**({"max_gen_len": 2 * N_NEW} | s)))
                for i, s in enumerate(settings)]
        while engine.running:
            engine.run(4)
    finally:
        llama.runner.forward_batch = forward
        llama.runner.allocate(max_seq_len=max_seq_len, num_blocks=None)
    assert engine.pool.num_used == 0
    return {"tokens": [s.tokens for s in seqs], "texts": [s.text for s in seqs],
            "finish_reasons": [s.finish_reason for s in seqs], "logprobs": [s.logprobs for s in seqs],
            "preemptions": engine.scheduler.preemptions, "carried": carried,
            "digest": engine.scheduler.digest.hexdigest()}


def budgeted(llama, slow: bool) -> dict:
    """One sequence decoded by run(16, seconds) until done (seconds: about 4 steps at rank 0's
    first pace), this rank's pace taken as three times what it measured when slow (as if the ranks' clocks disagreed), and the same
    sequence decoded a step at a time. Returns the steps each run took and both token lists."""
    prompt = llama.tokenizer.encode("Once upon a time", bos=True, eos=False)
    params = SamplingParams(max_gen_len=40, temperature=0, ignore_eos=True)
    engine = Engine(llama.runner, llama.tokenizer)
    plain = engine.add(prompt, params)
    while engine.running:
        engine.step()
    seq = engine.add(prompt, params)
    runs = [engine.run(16)]  # the prefill and the first token: a first pace
    seconds = torch.tensor([engine.pace * 4])
    dist.broadcast(seconds, src=0)  # one budget on every rank, about 4 steps of rank 0's
    while engine.running:
        runs.append(engine.run(16, seconds=float(seconds)))
        engine.pace *= 3 if slow else 1
    return {"runs": runs, "tokens": seq.tokens, "plain": plain.tokens}


def main():
    import llama2

    out_dir, folder, *mode = sys.argv[1:]
    world_size = int(os.environ["WORLD_SIZE"])
    llama = llama2.tp_llama(None, folder, None, world_size, max_batch_size=4,
                            max_seq_len=FLEX_MAX_SEQ_LEN if mode == ["flex"] else 256)
    if mode == ["constrained"]:
        result = {"constrained": constrained(llama)}
    elif mode == ["speculative"]:
        draft = draft_model(folder, world_size)
        draft.allocate(num_blocks=llama.runner.num_blocks)
        result = {"ngram": speculated(llama, NgramProposer()), "draft": speculated(llama, DraftProposer(draft))}
    elif mode == ["async"]:
        result = {config: workload(llama, *config, async_scheduling=True) for config in ASYNC_CONFIGS}
        result["mixed"] = mixed(llama, async_scheduling=True)
    elif mode == ["flex"]:
        llama.runner.attention = "flex"
        llama.runner.warm_up()  # as a worker loads: the graphs of test_attention.py's TorchServe
        result = {config: workload(llama, *config) for config in FLEX_CONFIGS} | {"preempted": preempted(llama)}
    else:
        result = {config: workload(llama, *config) for config in CONFIGS}
        result["budgeted"] = budgeted(llama, slow=dist.get_rank() == 1)
    torch.save(result, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
