"""Asynchronous scheduling against the synchronous step loop, in one run:

    python bench/async_scheduling.py [--rounds 3] [--no-write]

The demo checkpoint (fp32, eager, 1 thread, TP=1) decodes greedy requests to their
max_gen_len through Engine.run(16), as a server's iterations of 16 steps do, with
handler.async_scheduling off and on: batch 1 and batch 8, 128 new tokens each. Each
setting runs in a fresh process per round, which goes first alternating; a process reports
its best of 3 runs' tokens per second; the median over rounds is compared. On a CPU the
forward pass blocks the host, so there is nothing to overlap: this shows what the
bookkeeping costs. Writes its table into BENCHMARKS.md (asynchronous scheduling).
"""

import json
import os
import statistics

import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCHES = (1, 8)
NEW_TOKENS = 128

CHILD = """
import json, sys, time
import torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1])
import llama2
from engine import Engine
from sequence import SamplingParams
async_scheduling, batches, new = sys.argv[2] == "on", json.loads(sys.argv[3]), int(sys.argv[4])
llama = llama2.tp_llama(None, sys.argv[1] + "/demo", None, 1, max_batch_size=max(batches), max_seq_len=256)
prompts = [llama.tokenizer.encode(f"Story number {i}: once upon a time", bos=True, eos=False) for i in range(max(batches))]
params = SamplingParams(max_gen_len=new, temperature=0, ignore_eos=True)
out = {}
for batch in batches:
    best = 0.0
    for _ in range(3):
        engine = Engine(llama.runner, llama.tokenizer, max_seqs=batch, async_scheduling=async_scheduling)
        seqs = [engine.add(p, params) for p in prompts[:batch]]
        start = time.perf_counter()
        while engine.running:
            engine.run(16)
        best = max(best, sum(len(s.tokens) for s in seqs) / (time.perf_counter() - start))
    out[str(batch)] = best
print(json.dumps(out))
"""


def tokens_per_s(setting: str) -> dict:
    return report.fresh_process(CHILD, ROOT, setting, json.dumps(BATCHES), str(NEW_TOKENS))


def main():
    a = report.rounds_arguments(__doc__)
    runs = {"off": [], "on": []}
    for r in range(a.rounds):
        for setting in ("off", "on") if r % 2 == 0 else ("on", "off"):  # which goes first alternates
            runs[setting].append(tokens_per_s(setting))
            print(f"round {r + 1}", setting, runs[setting][-1], flush=True)
    lines = ["## Asynchronous scheduling", "", report.header(), "",
             f"The demo checkpoint (fp32, eager, 1 thread, TP=1) decoding {NEW_TOKENS} greedy tokens per request "
             f"through Engine.run(16); tokens per second, median of {a.rounds} rounds (each a fresh process's best "
             "of 3 runs, which setting goes first alternating); the ratio is on over off (>= 1: no slower). On a CPU the forward pass blocks the host, "
             "so nothing overlaps: the ratio is the bookkeeping's cost. The GPU figure is bench/gpu_check.sh's.", "",
             "| batch | off tokens/s | on tokens/s | on / off |", "|---|---|---|---|"]
    for batch in BATCHES:
        off, on = (statistics.median(run[str(batch)] for run in runs[s]) for s in ("off", "on"))
        lines.append(f"| {batch} | {off:.0f} | {on:.0f} | {on / off:.3f}x |")
    report.publish("async_scheduling", "\n".join(lines), write=not a.no_write)


if __name__ == "__main__":
    main()
