"""The attention backends against each other: FlexAttention reading the paged cache in place
gives gather + scaled_dot_product_attention's logits (fp32, 1e-4) for first chunks, chunks
after a cached prefix, shared prefix blocks and decoding rows at their own positions, and
the engine's greedy tokens with prefix caching, chunked prefill and preemption, at TP 1
and 2; auto picks flex for the steps that would gather many cached tokens, for a model
without grouped-query heads."""

import os
import random

import pytest

import llama2
import torchrun
from attention import GatherAttention
from batch import Batch
from block_quant import BlockLinear
from conftest import DEMO, ROOT, TOKENIZER, start_demo_server
from engine_worker import FLEX_CONFIGS, FLEX_MAX_SEQ_LEN, preempted, workload
from flex_attention import FlexAttention
from runner import FLEX_FROM_TOKENS
from torchrun import run
from tp_worker import max_diff


def steps(num_blocks: int, block_size: int, vocab: int) -> list[Batch]:
    """Three passes over three sequences whose blocks lie scattered in the pool: first chunks;
    a decode and a 201-token chunk after a cached prefix, starting mid-block; two decoding
    rows of one sequence (as speculation verifies them), another's, and a chunk whose
    sequence shares the first sequence's first four blocks (a cached prefix)."""
    order = random.Random(0).sample(range(num_blocks), num_blocks)
    tables = [order[:26], order[26:29], order[:4] + order[29:31]]
    rng = random.Random(1)

    def tokens(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    batches = [Batch([], [], []) for _ in range(3)]
    batches[0].add(tokens(200), 0, tables[0], block_size, decode=False)
    batches[0].add(tokens(37), 0, tables[1], block_size, decode=False)
    batches[1].add(tokens(1), 37, tables[1], block_size, decode=True)
    batches[1].add(tokens(201), 200, tables[0], block_size, decode=False)
    for row, position in ((0, 401), (1, 38), (1, 39)):
        batches[2].add(tokens(1), position, tables[row], block_size, decode=True)
    batches[2].add(tokens(30), 64, tables[2], block_size, decode=False)
    return batches


@pytest.fixture(scope="module")
def demo():
    """DEMO (GQA) on the pool of this module's flex runs at TP=2 and its TorchServe's, one
    runner for the tests below, warmed up as a worker that loads it with flex: flex's graphs
    compile once, and those of such a worker (test_an_eager_worker_compiles_flex_as_it_loads)
    come from inductor's cache."""
    llama = llama2.tp_llama(None, DEMO, None, 1, max_batch_size=4, max_seq_len=FLEX_MAX_SEQ_LEN,
                            attention="flex")
    llama.runner.warm_up()
    llama.runner.attention = "sdpa"
    return llama


@pytest.mark.slow  # torch.compile (flex)
def test_flex_gives_the_gathered_logits(demo):
    runner = demo.runner
    logits = {}
    for backend in ("sdpa", "flex"):
        runner.attention = backend
        runner.attach_cache(runner.num_blocks)  # zeroed
        logits[backend] = [runner.forward_batch(b) for b in steps(runner.num_blocks, runner.block_size,
                                                                   runner.vocab_size)]
    for i, (a, b) in enumerate(zip(logits["sdpa"], logits["flex"])):
        assert a.shape == b.shape and max_diff(a, b) <= 1e-4, f"pass {i}"
    runner.attention = "sdpa"


def test_auto_picks_flex_for_steps_that_gather_many_tokens(checkpoints):
    runner = llama2.tp_llama(None, checkpoints["mha"][1]["hf"], TOKENIZER, 1, max_batch_size=4,
                             max_seq_len=1024).runner
    assert runner.attention == "auto" and runner.may_use_flex()
    size = runner.block_size

    def picked(rows: int, context: int, chunk_after: int = 0) -> type:
        batch = Batch([], [], [])
        blocks = -(-context // size)
        for row in range(rows):
            batch.add([5], context - 1, list(range(row * blocks, (row + 1) * blocks)), size, decode=True)
        if chunk_after:
            batch.add([5] * 8, chunk_after, list(range(-(-(chunk_after + 8) // size))), size, decode=False)
        return type(runner.model_inputs(batch)[2])

    assert picked(1, 64) is GatherAttention
    assert picked(1, FLEX_FROM_TOKENS) is FlexAttention
    assert picked(FLEX_FROM_TOKENS // 256, 256) is FlexAttention
    assert picked(1, 64, chunk_after=FLEX_FROM_TOKENS) is FlexAttention  # a cached prefix is gathered too
    runner.attention = "sdpa"
    assert picked(8, 1024) is GatherAttention
    runner.attention = "flex"
    assert picked(1, 16) is FlexAttention
    # a pool short of FLEX_FROM_TOKENS reaches them only through a prefix the rows share: auto stays with sdpa
    runner.attention = "auto"
    runner.allocate(num_blocks=FLEX_FROM_TOKENS // size - 1)
    assert not runner.may_use_flex()
    assert picked(4, FLEX_FROM_TOKENS // 4) is GatherAttention
    # with grouped-query heads flex measured no faster than sdpa on CPU (docs/tuning-log.md): auto stays with sdpa
    runner = llama2.tp_llama(None, checkpoints["gqa"][1]["hf"], TOKENIZER, 1, max_batch_size=4,
                             max_seq_len=1024).runner
    assert runner.attention == "auto" and not runner.may_use_flex()
    assert picked(FLEX_FROM_TOKENS // 256, 256) is GatherAttention


@pytest.fixture(scope="module")
def sdpa_runs(demo):
    """The references with gather + SDPA, computed once for the tests below: workload() for
    each of FLEX_CONFIGS, and preempted() (what the TP=2 ranks run with flex)."""
    demo.runner.attention = "sdpa"
    return {config: workload(demo, *config) for config in FLEX_CONFIGS} | {"preempted": preempted(demo)}


@pytest.mark.slow  # torch.compile (flex)
def test_flex_gives_the_same_greedy_tokens_in_the_engine(demo, sdpa_runs):
    """test_engine.py's workload (a shared system prompt, sequences joining and leaving,
    a long prompt, a repeat served from the prefix cache) in chunks of 16 and 64 tokens and
    whole: the same tokens and scheduling decisions with either backend."""
    demo.runner.attention = "flex"
    for caching, budget in FLEX_CONFIGS:
        assert workload(demo, caching, budget) == sdpa_runs[(caching, budget)], (caching, budget)
    demo.runner.attention = "sdpa"


@pytest.mark.slow  # torch.compile (flex)
def test_flex_does_not_compile_again_as_batches_and_contexts_change(demo):
    """Its compiled graphs, once made for rows of one and of two and for chunks after a
    cached prefix, serve batches of up to four rows, other contexts and other chunks."""
    import torch

    demo.runner.attention = "flex"
    workload(demo, True, 16, max_seqs=2)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for caching, budget in FLEX_CONFIGS:
            workload(demo, caching, budget, max_seqs=4)
    demo.runner.attention = "sdpa"


@pytest.mark.slow  # torch.compile (flex)
def test_flex_gives_the_same_tokens_under_preemption(demo, sdpa_runs):
    runs = {"sdpa": sdpa_runs["preempted"]}
    demo.runner.attention = "flex"
    runs["flex"] = preempted(demo)
    demo.runner.attention = "sdpa"
    assert runs["flex"] == runs["sdpa"] and len(runs["sdpa"]["victims"]) >= 2  # preempted, alike


@pytest.mark.slow
def test_flex_at_tp2_gives_tp1_tokens(sdpa_runs, tmp_path):
    ranks = run("engine_worker.py", 2, tmp_path, DEMO, "flex")
    for rank in ranks:
        assert rank == sdpa_runs


def compiled_auto_decode_steps(runner) -> list:
    """Decode steps of 8 rows with long contexts (auto's flex) and of one short row (sdpa), in
    turns."""
    vocab, size = runner.vocab_size, runner.block_size
    out = []
    for step in range(4):
        rows, position = (8, 300 + step) if step % 2 == 0 else (1, 40 + step)
        batch = Batch([], [], [])
        for row in range(rows):
            table = list(range(row * 32, row * 32 + position // size + 1))
            batch.add([(7 * step + row) % (vocab - 3) + 3], position, table, size, decode=True)
        out.append(runner.forward_batch(batch))
    return out


@pytest.mark.slow  # torch.compile
def test_compiled_auto_switches_backends_as_eager_sdpa_does(checkpoints):
    """compile_decode() with auto: compiled_auto_decode_steps give the eager gather + SDPA
    logits (an MHA model: there, without flex's graphs compiled first, inductor failed to
    compile them), unquantized and with each QUANT's layers (on the CPU: block_quant's kernels,
    opaque ops in the graph). The three models compile in turn in this process: each compile
    drops the graphs before it (which, without guards on modules, would run on its modules
    and fail), and the model compiled before runs eager, as it did before compiling."""
    earlier = None
    for quantization in (None, "int8", "int4"):
        runner = llama2.tp_llama(None, checkpoints["mha"][1]["hf"], TOKENIZER, 1, max_batch_size=8,
                                 max_seq_len=512, attention="sdpa", quantization=quantization).runner
        assert (quantization is None) == (not any(isinstance(m, BlockLinear) for m in runner.model.modules()))
        eager = compiled_auto_decode_steps(runner)
        runner.attention = "auto"
        runner.compile_decode()
        runner.attach_cache(runner.num_blocks)  # zeroed, as the eager steps saw it
        compiled = compiled_auto_decode_steps(runner)
        for i, (a, b) in enumerate(zip(eager, compiled)):
            assert max_diff(a, b) <= 1e-4, f"{quantization}, step {i}"
        if earlier is not None:  # with sdpa, as its reference: eager flex would compile flex again
            assert earlier[0].compiled_decode is None
            earlier[0].attention = "sdpa"
            earlier[0].attach_cache(earlier[0].num_blocks)
            for i, (a, b) in enumerate(zip(earlier[1], compiled_auto_decode_steps(earlier[0]))):
                assert max_diff(a, b) <= 1e-4, f"the model before {quantization}, step {i}"
        earlier = runner, eager


@pytest.mark.slow  # a TorchServe
def test_torchserve_with_flex_answers_as_in_process(tmp_path, demo_llama):
    """handler.attention: flex on a TP=2 TorchServe, with asynchronous scheduling, one step an
    iteration (each iteration's tokens reach the host in the next): its workers attend with
    FlexAttention (their log says so) and answer greedy prompts, one of them long, as the
    model in this process does, whole and streamed, with a stop string too."""
    prompts = ["The secret of a happy life is", "Once upon a time", "A long prompt: " + " ".join(map(str, range(90)))]
    expected = demo_llama.text_completion(prompts, 24, temperature=0)
    stop = expected[0]["generation"][10:14]
    stopped = demo_llama.text_completion(prompts[:1], 24, temperature=0, stop=[stop])[0]
    server = start_demo_server(tmp_path, attention="flex", async_scheduling=True, steps_per_iteration=1)
    try:
        answers = server.generate({"prompt": prompts, "temperature": 0, "max_new_tokens": 24})
        chunks = server.stream({"prompt": prompts[0], "temperature": 0, "max_new_tokens": 24, "stop": stop})
        log = server.log()
    finally:
        server.stop(wait=False)
    assert [a["generation"] for a in answers] == [e["generation"] for e in expected]
    assert "".join(c["text"] for c in chunks) == stopped["generation"] and chunks[-1]["finish_reason"] == "stop"
    assert "prefix caching on, attention flex, async scheduling on," in log


def in_a_process(*args: str) -> str:
    """What tests/flex_worker.py with args prints, in a process of its own on one thread, as this
    one: inductor's cache keys hold the thread count, and the demo fixture's warm-up compiled
    the kernels on its pool (128 blocks); the graphs are the process's own."""
    output = torchrun.output_of(os.path.join(ROOT, "tests", "flex_worker.py"), *args,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    return output.split()[-1]


@pytest.mark.slow  # torch.compile (flex)
def test_a_process_whose_first_flex_step_decodes_16_rows():
    """In a fresh process, eager, the first FlexAttention step decodes 16 rows: compiled first
    for that count, inductor's CPU template generated C++ that did not compile (torch 2.13),
    so flex_attention.warm_decode compiles it for one row and two first."""
    assert float(in_a_process("first-step", DEMO)) < 1e-4


@pytest.mark.slow  # torch.compile (flex)
@pytest.mark.parametrize("attention, compiled", [("flex", True), ("sdpa", False), ("auto", False)])
def test_an_eager_worker_compiles_flex_as_it_loads(attention, compiled):
    """An eager worker that may attend with FlexAttention compiles its kernel as it loads, not
    in its first flex step (a 13 s step that held every stream); one that never uses it
    compiles nothing: sdpa, or auto for DEMO's grouped-query heads (runner.may_use_flex, which
    test_auto_picks_flex_for_steps_that_gather_many_tokens checks, is loading's rule)."""
    assert in_a_process("load", DEMO, attention, str(FLEX_MAX_SEQ_LEN)) == str(compiled)
