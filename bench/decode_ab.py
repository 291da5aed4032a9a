"""Decode speed of this tree against earlier commits, on the same machine in one run:

    python bench/decode_ab.py [--baseline 16d4a67 [COMMIT ...]] [--rounds 3] [--calls 7] [--no-write]

generate.generate (greedy, prompt 32, 64 new tokens, EOS off) at batch 1 and 8, TP=1 with
1 thread, on bench/decode.py's random 26M and 110M shapes (Meta layout, fp32). Each round
starts one process per tree (a baseline's files from `git archive`) and then times single
calls in turn: one call of each tree, the order alternating, --calls times per batch size.
Pairs of calls a few seconds apart meet the same machine, so the drift of a shared machine
(a tree's fresh processes in turn, minutes apart, moved ±15% on the 2-core machine) cancels
in each pair's ratio; fresh processes each round keep one process's memory layout from
deciding. The ratio reported is the median over every pair of all rounds. Writes its table
into BENCHMARKS.md (decode_ab).
"""

import os
import statistics
import sys
import tempfile

import report
from report import LoadedProcess, alternating_calls, checkout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]
SHAPES = {"26M": (512, 8, 8), "110M": (768, 12, 12)}
NEW, PROMPT = 64, 32

RUN = """
import sys, time
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
prompts = {b: [torch.randint(3, 4000, (%(prompt)d,), generator=g).tolist() for _ in range(b)] for b in (1, 8)}
for b in prompts:
    generate.generate(runner, prompts[b], 8, temperature=0, tokenizer=tok)
print("ready", flush=True)
for line in sys.stdin:  # a batch size: one timed call
    t = time.perf_counter()
    generate.generate(runner, prompts[int(line)], %(new)d, temperature=0, tokenizer=tok)
    print(time.perf_counter() - t, flush=True)
""" % {"prompt": PROMPT, "new": NEW}


def paired_round(trees: dict, ckpt: str, calls: int) -> dict:
    """{batch: {name: [seconds of each call]}}: calls of each tree in turn, the order alternating."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = {name: LoadedProcess(RUN, tree, ckpt, env=env) for name, tree in trees.items()}
    answers = alternating_calls(procs, calls, ["1", "8"])
    return {int(b): {name: [float(t) for t in times] for name, times in by_tree.items()} for b, by_tree in answers.items()}


def main():
    a = report.ab_arguments(__doc__, "16d4a67", rounds=3, calls=7)
    import make_checkpoint
    from tokenizer import Tokenizer

    tokenizer = os.path.join(ROOT, "demo", "tokenizer.model")
    rows = []
    with tempfile.TemporaryDirectory(prefix="decode_ab_") as tmp:
        trees = {"now": ROOT} | {commit: checkout(commit, os.path.join(tmp, commit)) for commit in a.baseline}
        for shape, (dim, layers, heads) in SHAPES.items():
            model = make_checkpoint.random_hf_model(dim, layers, heads, heads, Tokenizer(tokenizer).n_words, seed=0)
            ckpt = make_checkpoint.write_layouts(model, os.path.join(tmp, shape), tokenizer, ["meta:1"])["meta:1"]
            rounds = [paired_round(trees, ckpt, a.calls) for _ in range(a.rounds)]
            for batch in (1, 8):
                now = [t for r in rounds for t in r[batch]["now"]]
                cells = []
                for commit in a.baseline:
                    base = [t for r in rounds for t in r[batch][commit]]
                    per_round = ", ".join(f"{statistics.median(b / n for b, n in zip(r[batch][commit], r[batch]['now'])):.3f}"
                                          for r in rounds)
                    ratio = statistics.median(b / n for b, n in zip(base, now))
                    cells.append(f"{batch * NEW / statistics.median(base):.1f} | **{ratio:.3f}** ({per_round})")
                rows.append(f"| {shape} | {batch} | {batch * NEW / statistics.median(now):.1f} | " + " | ".join(cells) + " |")
                print(rows[-1], flush=True)
    heads = "".join(f" {c} (tokens/s) | now / {c} (each round) |" for c in a.baseline)
    text = f"""## Decode speed against an earlier commit

`python bench/decode_ab.py {' '.join(sys.argv[1:])}` — {report.header()}; baseline commits \
{', '.join(a.baseline)}, {a.rounds} rounds of fresh processes, each timing {a.calls} calls per batch of each tree in turn \
(the order alternating).

`generate.generate`, greedy, prompt {PROMPT} tokens, {NEW} new tokens, EOS off, TP=1, 1 thread, random fp32 \
models of bench/decode.py's shapes (Meta layout, demo vocabulary); tokens/s of the median call; the ratio is \
the median over all pairs of calls of the baseline's time / this tree's (each round's median in brackets):

| model | batch | now (tokens/s) |{heads}
|---|---|---|{"---|---|" * len(a.baseline)}
""" + "\n".join(rows) + "\n"
    report.publish("decode_ab", text, not a.no_write)


if __name__ == "__main__":
    main()
