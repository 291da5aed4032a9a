"""Decode speed of this tree against earlier commits, on the same machine in one run:

    python bench/decode_ab.py [--baseline 16d4a67 [COMMIT ...]] [--rounds 3] [--no-write]

generate.generate (greedy, prompt 32, 64 new tokens, EOS off) at batch 1 and 8, TP=1 with
1 thread, on bench/decode.py's random 26M and 110M shapes (Meta layout, fp32). Each round
runs each baseline and this tree one after the other, each in a fresh process (a
baseline's files from `git archive`), so that the machine's drift hits all alike; each
process reports its fastest of 5 calls (what other load on a shared machine adds to a call
is noise, never less time), and the median over rounds is compared. Writes its table into BENCHMARKS.md (decode_ab).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import report
from report import checkout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]
SHAPES = {"26M": (512, 8, 8), "110M": (768, 12, 12)}
NEW, PROMPT, REPS = 64, 32, 5

RUN = """
import json, statistics, sys, time
import torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1])
import generate, llama2
class NoEos:  # exactly NEW tokens; the text is made as usual
    def __init__(self, tok):
        self.decode, self.eos_id, self.stop_ids = tok.decode, -1, frozenset()
llama = llama2.tp_llama(None, sys.argv[2], sys.argv[2] + "/tokenizer.model", 1, max_batch_size=8, max_seq_len=128)
tok = NoEos(llama.tokenizer)
runner = getattr(llama, "runner", llama.model)  # trees before the runner split run the model itself
g = torch.Generator().manual_seed(0)
out = {}
for batch in (1, 8):
    prompts = [torch.randint(3, 4000, (%(prompt)d,), generator=g).tolist() for _ in range(batch)]
    generate.generate(runner, prompts, 8, temperature=0, tokenizer=tok)
    times = []
    for _ in range(%(reps)d):
        t = time.perf_counter()
        generate.generate(runner, prompts, %(new)d, temperature=0, tokenizer=tok)
        times.append(time.perf_counter() - t)
    out[batch] = batch * %(new)d / min(times)  # other load on the machine only ever adds time
print(json.dumps(out))
""" % {"prompt": PROMPT, "new": NEW, "reps": REPS}


def tokens_per_s(tree: str, ckpt: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", RUN, tree, ckpt], capture_output=True, text=True, env=env, check=True)
    return {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", nargs="+", default=["16d4a67"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    import make_checkpoint
    from tokenizer import Tokenizer

    tokenizer = os.path.join(ROOT, "demo", "tokenizer.model")
    rows = []
    with tempfile.TemporaryDirectory(prefix="decode_ab_") as tmp:
        trees = {"now": ROOT} | {commit: checkout(commit, os.path.join(tmp, commit)) for commit in a.baseline}
        for shape, (dim, layers, heads) in SHAPES.items():
            model = make_checkpoint.random_hf_model(dim, layers, heads, heads, Tokenizer(tokenizer).n_words, seed=0)
            ckpt = make_checkpoint.write_layouts(model, os.path.join(tmp, shape), tokenizer, ["meta:1"])["meta:1"]
            runs = {name: [] for name in trees}
            for _ in range(a.rounds):
                for name, tree in trees.items():
                    runs[name].append(tokens_per_s(tree, ckpt))
            for batch in (1, 8):
                now = statistics.median(r[batch] for r in runs["now"])
                cells = []
                for commit in a.baseline:
                    base = statistics.median(r[batch] for r in runs[commit])
                    each = ", ".join(f"{n[batch] / b[batch]:.3f}" for n, b in zip(runs["now"], runs[commit]))
                    cells.append(f"{base:.1f} | **{now / base:.3f}** ({each})")
                rows.append(f"| {shape} | {batch} | {now:.1f} | " + " | ".join(cells) + " |")
                print(rows[-1], flush=True)
    heads = "".join(f" {c} (tokens/s) | now / {c} (each round) |" for c in a.baseline)
    text = f"""## Decode speed against an earlier commit

`python bench/decode_ab.py {' '.join(sys.argv[1:])}` — {report.header()}; baseline commits \
{', '.join(a.baseline)}, {a.rounds} rounds, each running the baselines and this tree in turn in fresh processes.

`generate.generate`, greedy, prompt {PROMPT} tokens, {NEW} new tokens, EOS off, TP=1, 1 thread, random fp32 \
models of bench/decode.py's shapes (Meta layout, demo vocabulary); each process's fastest of {REPS} calls, \
median tokens/s over the rounds:

| model | batch | now (tokens/s) |{heads}
|---|---|---|{"---|---|" * len(a.baseline)}
""" + "\n".join(rows) + "\n"
    report.publish("decode_ab", text, not a.no_write)


if __name__ == "__main__":
    main()
