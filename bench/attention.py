"""Attention backends against each other: the time of one decode step of the whole model
with FlexAttention reading the paged cache in place (flex), with each sequence's blocks
gathered for scaled_dot_product_attention (sdpa), and with the default (auto: flex for steps
that would gather at least runner.FLEX_FROM_TOKENS cached tokens), in one run:

    python bench/attention.py [--rounds 3] [--no-write]

Random weights of bench/decode.py's 26M shape (fp32, 1 thread, TP=1), the model eager and
compiled (handler.compile), at batch 8 with 2,048-token contexts and at batch 1 with short
ones. Each (backend, mode) runs in a fresh process per round, rounds alternating, each
process reporting its fastest median of 3 runs of 20 steps; the median over rounds is
compared. The cache holds junk: a step's time does not depend on the values. Writes its
table into BENCHMARKS.md (attention backends).
"""

import json
import os
import statistics

import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIM, LAYERS, HEADS, VOCAB = 512, 8, 8, 32000  # the 26M shape
CASES = [(8, 2048), (8, 512), (1, 2048), (1, 1024), (1, 64)]  # (rows, context tokens)
BACKENDS = ("sdpa", "flex", "auto")
STEPS = 20

CHILD = """
import json, statistics, sys, time
import torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1])
from batch import Batch
from model import ModelArgs, Transformer
from runner import ModelRunner
backend, compiled, cases = sys.argv[2], sys.argv[3] == "compiled", json.loads(sys.argv[4])
torch.manual_seed(0)
args = ModelArgs(dim=%(dim)d, n_layers=%(layers)d, n_heads=%(heads)d, vocab_size=%(vocab)d, max_seq_len=2048)
model = Transformer(args)
for p in model.parameters():
    torch.nn.init.normal_(p, std=0.02)
model.eval()
runner = ModelRunner(model, 8, 2048, attention=backend)
if compiled:
    runner.compile_decode()
out = {}
for rows, context in cases:
    blocks = -(-context // runner.block_size)
    batch = Batch(tokens=[], positions=[], slots=[])
    for row in range(rows):  # the last token of a context-long sequence
        table = list(range(row * blocks, (row + 1) * blocks))
        batch.add([row + 1], context - 1, table, runner.block_size, decode=True)
    for _ in range(3):
        runner.forward_batch(batch)
    medians = []
    for _ in range(3):
        times = []
        for _ in range(%(steps)d):
            t = time.perf_counter()
            runner.forward_batch(batch)
            times.append(time.perf_counter() - t)
        medians.append(statistics.median(times))
    out[f"{rows}x{context}"] = min(medians) * 1000
print(json.dumps(out))
""" % {"dim": DIM, "layers": LAYERS, "heads": HEADS, "vocab": VOCAB, "steps": STEPS}


def step_ms(backend: str, mode: str) -> dict:
    return report.fresh_process(CHILD, ROOT, backend, mode, json.dumps(CASES))


def main():
    a = report.rounds_arguments(__doc__)
    runs = {(backend, mode): [] for mode in ("eager", "compiled") for backend in BACKENDS}
    for r in range(a.rounds):
        for key in runs:
            runs[key].append(step_ms(*key))
            print(f"round {r + 1}", key, runs[key][-1], flush=True)
    lines = ["## Attention backends: FlexAttention in place against gather + SDPA", "", report.header(), "",
             f"One decode step of the whole model (26M shape: dim {DIM}, {LAYERS} layers, {HEADS} heads, "
             f"vocabulary {VOCAB}; fp32, 1 thread), ms, median of {a.rounds} rounds (each a fresh process's "
             f"fastest median of 3 x {STEPS} steps); a speed-up is sdpa's time over the backend's (> 1: faster).", "",
             "| rows x context | mode | sdpa ms | flex ms | auto ms | flex speed-up | auto speed-up |",
             "|---|---|---|---|---|---|---|"]
    for rows, context in CASES:
        case = f"{rows}x{context}"
        for mode in ("eager", "compiled"):
            sdpa, flex, auto = (statistics.median(run[case] for run in runs[(b, mode)]) for b in BACKENDS)
            lines.append(f"| {rows} x {context:,} | {mode} | {sdpa:.2f} | {flex:.2f} | {auto:.2f} | "
                         f"{sdpa / flex:.2f}x | {sdpa / auto:.2f}x |")
    report.publish("attention", "\n".join(lines), write=not a.no_write)


if __name__ == "__main__":
    main()
