"""Prompt speed with QUANT=int4 (block_quant's layers) of this tree against earlier commits,
on the same machine in one run:

    python bench/prefill_ab.py [--baseline 77f93ff [COMMIT ...]] [--rounds 2] [--calls 5] [--no-write]

SmolLM2-135M-Instruct's Q4_1 file (make smollm2) with its blocks kept, TP=1, 2 threads: one
prompt of 665 tokens prefilled and one token decoded (`text_completion`, greedy). Each round
starts one process per tree and times single calls in turn, the order alternating, as
bench/decode_ab.py does; the ratio is the median over all pairs of calls of the baseline's time
/ this tree's. Writes its table into BENCHMARKS.md (prefill_ab).
"""

import os
import statistics
import sys
import tempfile

import report
from report import LoadedProcess, alternating_calls, checkout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2 = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
THREADS = 2

RUN = """
import sys, time
import torch
torch.set_num_threads(%(threads)d)
sys.path.insert(0, sys.argv[1])
import llama2
llama = llama2.tp_llama(None, sys.argv[2], None, 1, max_batch_size=1, max_seq_len=1024, quantization="int4")
prompt = "The history of the city " + " ".join(f"in the year {1000 + i} the river rose" for i in range(60))
llama.text_completion([prompt], 1, temperature=0)
print("ready", flush=True)
for line in sys.stdin:  # one timed call
    t = time.perf_counter()
    first = llama.text_completion([prompt], 1, temperature=0)[0]["generation"]
    print(time.perf_counter() - t, repr(first), flush=True)
""" % {"threads": THREADS}


def paired_round(trees: dict, calls: int) -> dict:
    """{name: [(seconds, first token) of each call]}: calls of each tree in turn, the order alternating."""
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
    procs = {name: LoadedProcess(RUN, tree, SMOLLM2, env=env) for name, tree in trees.items()}
    answers = alternating_calls(procs, calls, [""])[""]
    return {name: [(float(seconds), first.strip()) for seconds, first in (a.split(" ", 1) for a in by_call)]
            for name, by_call in answers.items()}


def main():
    a = report.ab_arguments(__doc__, "77f93ff", rounds=2, calls=5)
    import torch

    bf16 = "with" if torch.cpu._is_avx512_bf16_supported() else "without"
    with tempfile.TemporaryDirectory(prefix="prefill_ab_") as tmp:
        trees = {"now": ROOT} | {commit: checkout(commit, os.path.join(tmp, commit)) for commit in a.baseline}
        rounds = [paired_round(trees, a.calls) for _ in range(a.rounds)]
    seconds = {name: [s for r in rounds for s, _ in r[name]] for name in trees}
    firsts = {name: sorted({f for r in rounds for _, f in r[name]}) for name in trees}
    rows = [f"| now | {statistics.median(seconds['now']) * 1e3:.0f} | {', '.join(firsts['now'])} | |"]
    for commit in a.baseline:
        ratio = statistics.median(b / n for b, n in zip(seconds[commit], seconds["now"]))
        rows.append(f"| {commit} | {statistics.median(seconds[commit]) * 1e3:.0f} | {', '.join(firsts[commit])} "
                    f"| **{ratio:.2f}** |")
    text = f"""## Prompt speed with QUANT=int4 against an earlier commit

`python bench/prefill_ab.py {' '.join(sys.argv[1:])}` — {report.header()}; {a.rounds} rounds of fresh processes, \
each timing {a.calls} calls of each tree in turn (the order alternating).

A CPU {bf16} AVX512-BF16. SmolLM2-135M-Instruct's Q4_1 file with QUANT=int4 (its blocks kept: block_quant's layers), \
TP=1, {THREADS} threads: a \
prompt of 665 tokens prefilled and one token decoded, greedy (`text_completion`). Milliseconds of the median call, \
the first token each tree gave, and the median over all pairs of calls of the baseline's time / this tree's:

| tree | ms | first token | baseline / now |
|---|---|---|---|
""" + "\n".join(rows) + "\n"
    report.publish("prefill_ab", text, not a.no_write)


if __name__ == "__main__":
    main()
