"""The sampler's cost against an earlier commit, on the same machine in one run:

    python bench/sampling_ab.py [--baseline 9de82c0] [--gguf models/SmolLM2-135M-Instruct.Q4_1.gguf] [--calls 5] [--no-write]

- sampler: sampler.sample alone on random peaked logits (vocabularies of 49,152 and
  128,256 tokens, SmolLM2's and Llama 3's), batch 1 and 8: greedy, temperature 0.7 with
  top_p 0.9 (the server's default) and with top_p 1 (OpenAI's default, which clients send);
  the median of 200 calls, microseconds.
- decode: generate.generate on the GGUF file (QUANT=int4, eager, 2 threads), 8 prompts,
  128 new tokens, EOS off, temperature 0.7, top_p 1 and 0.9: output tokens/s.

One process per tree (a baseline's files from `git archive`); the trees' calls alternate,
--calls times each, and the ratio is the median over the pairs. Writes its table into
BENCHMARKS.md (sampling_ab).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

import report
from report import LoadedProcess, checkout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCABS = (49152, 128256)
SETTINGS = {"greedy": (0.0, 1.0), "top_p 0.9": (0.7, 0.9), "top_p 1": (0.7, 1.0)}
NEW = 128

RUN = """
import json, statistics, sys, time
import torch
torch.set_num_threads(2)
sys.path.insert(0, sys.argv[1])
import generate, llama2, sampler, sequence
settings, vocabs, new = json.loads(sys.argv[3])

def sampler_us(vocab, batch, temperature, top_p):
    g = torch.Generator().manual_seed(vocab + batch)
    logits = torch.randn(batch, vocab, generator=g) * 3
    logits[:, :20] += 12  # a few likely tokens, as a model gives
    seqs = [sequence.Sequence([1], sequence.SamplingParams(1, temperature=temperature, top_p=top_p, seed=i), i,
                              torch.Generator().manual_seed(i)) for i in range(batch)]
    times = []
    for _ in range(220):
        t = time.perf_counter()
        sampler.sample(logits, seqs)
        times.append(time.perf_counter() - t)
    return statistics.median(times[20:]) * 1e6

class NoEos:  # exactly `new` tokens; the text is made as usual
    def __init__(self, tok):
        self.decode, self.eos_id, self.stop_ids = tok.decode, -1, frozenset()

llama = llama2.tp_llama(None, sys.argv[2], sys.argv[2], 1, max_batch_size=8, max_seq_len=256, quantization="int4")
tok = NoEos(llama.tokenizer)
prompts = [llama.tokenizer.encode(f"Story {i}: once upon a time", bos=True, eos=False) for i in range(8)]
generate.generate(llama.runner, prompts, 8, temperature=0.7, tokenizer=tok)
for temperature, top_p in settings.values():  # the allocator's state after every path, before any timing
    for v in vocabs:
        sampler_us(v, 8, temperature, top_p)
print("ready", flush=True)
for line in sys.stdin:
    part, name = line.split(maxsplit=1)
    temperature, top_p = settings[name.strip()]
    if part == "sampler":
        print(json.dumps({f"{v} {b}": sampler_us(v, b, temperature, top_p) for v in vocabs for b in (1, 8)}), flush=True)
    else:
        t = time.perf_counter()
        generate.generate(llama.runner, prompts, new, temperature=temperature, top_p=top_p, seed=1, tokenizer=tok)
        print(json.dumps(len(prompts) * new / (time.perf_counter() - t)), flush=True)
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="9de82c0")
    ap.add_argument("--gguf", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sampling_ab_") as tmp:
        settings = json.dumps([SETTINGS, VOCABS, NEW])
        trees = {name: LoadedProcess(RUN, tree, a.gguf, settings)
                 for name, tree in (("now", ROOT), (a.baseline, checkout(a.baseline, os.path.join(tmp, "base"))))}
        got = {}  # (part, setting, name) -> [answers]
        for call in range(a.calls):
            for part in ("sampler", "decode"):
                for setting in SETTINGS if part == "sampler" else ("top_p 1", "top_p 0.9"):
                    for name in list(trees)[::1 if call % 2 == 0 else -1]:
                        answer = json.loads(trees[name].ask(f"{part} {setting}"))
                        got.setdefault((part, setting, name), []).append(answer)
        for tree in trees.values():
            tree.close()
    now, base = "now", a.baseline
    rows = []
    for setting in SETTINGS:
        for key in got["sampler", setting, now][0]:
            vocab, batch = key.split()
            mine = statistics.median(c[key] for c in got["sampler", setting, now])
            theirs = statistics.median(c[key] for c in got["sampler", setting, base])
            rows.append(f"| sampler, {setting}, vocabulary {vocab}, batch {batch} (µs) | {theirs:.0f} | {mine:.0f} | "
                        f"**{mine / theirs:.2f}** |")
    for setting in ("top_p 1", "top_p 0.9"):
        mine, theirs = got["decode", setting, now], got["decode", setting, base]
        ratio = statistics.median(m / t for m, t in zip(mine, theirs))
        rows.append(f"| decode, SmolLM2 int4, batch 8, temperature 0.7, {setting} (output tokens/s) | "
                    f"{statistics.median(theirs):.1f} | {statistics.median(mine):.1f} | **{ratio:.2f}** |")
    print("\n".join(rows))
    text = f"""## Sampling cost against an earlier commit

`python bench/sampling_ab.py {' '.join(sys.argv[1:])}` — {report.header()}; baseline {a.baseline}, \
{a.calls} calls of each tree in turn (the order alternating), one process per tree, 2 threads.

What changed since the baseline: docs/tuning-log.md. Sampler rows: median microseconds of
`sampler.sample` on random peaked logits (ratio: now / baseline, lower is better). Decode rows:
`generate.generate` on {os.path.basename(a.gguf)}, QUANT=int4, eager, 8 prompts, {NEW} new tokens, EOS off
(ratio: now / baseline tokens/s, the median of the pairs' ratios).

| measure | {base} | now | ratio |
|---|---|---|---|
""" + "\n".join(rows) + "\n"
    report.publish("sampling_ab", text, not a.no_write)


if __name__ == "__main__":
    main()
