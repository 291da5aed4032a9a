"""Speculative decoding against plain decoding, on the same machine in one run:

    python bench/speculative.py [--rounds 3] [--new 64] [--no-write]

engine.Engine at TP=1, 1 thread, on two models: the demo checkpoint (trained: acceptance
as text gives it) and bench/decode.py's 110M shape (random fp32 weights, seed 0: the step
costs of a larger model; a random model's greedy text soon repeats itself, so its
acceptance says little about real text). Draft models: the target's own first layers (its
embeddings, final norm and output kept: an early-exit draft), written as a checkpoint of
their own. Workloads: *grounded*, prompts that quote a passage and ask for it again;
*open*, prompts that do not. Each configuration: batch sequences of `--new` tokens, EOS
off; tokens/s = tokens / wall time of the whole run (prefill included), median over the
rounds, each round running every method in turn. Writes its tables into BENCHMARKS.md.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]

import llama2  # noqa: E402
from engine import Engine  # noqa: E402
from sequence import SamplingParams  # noqa: E402
from speculative import DraftProposer, NgramProposer, Speculation  # noqa: E402

PASSAGE = ("The committee met on Tuesday to review the budget. After a long discussion, the members agreed to "
           "fund the new library, repair the bridge on Mill Street, and hire two more teachers for the school. "
           "The mayor thanked everyone and said the town would vote on the plan in May.")
GROUNDED = [f"{PASSAGE}\nRepeat the text above exactly.\n{PASSAGE[:40]}",
            f"Notes: {PASSAGE}\nCopy the notes: {PASSAGE[:25]}",
            f"def area(width, height):\n    return width * height\n\n# {PASSAGE[:80]}\n"
            "Rewrite it with the same names:\ndef area(width, height):\n"]
OPEN = ["Once upon a time", "The best advice I ever got was", "Why do people like music?"]
K = 4
DRAFT_LAYERS = {"demo": 2, "110M": 3}  # a quarter of the layers


def truncated(folder: str, n_layers: int, out: str) -> str:
    """A Meta-layout checkpoint of folder's first n_layers layers."""
    os.makedirs(out, exist_ok=True)
    weights = torch.load(os.path.join(folder, "consolidated.00.pth"), weights_only=True, mmap=True)
    kept = {k: v for k, v in weights.items() if not k.startswith("layers.") or int(k.split(".")[1]) < n_layers}
    torch.save(kept, os.path.join(out, "consolidated.00.pth"))
    with open(os.path.join(folder, "params.json")) as f:
        params = json.load(f) | {"n_layers": n_layers}
    with open(os.path.join(out, "params.json"), "w") as f:
        json.dump(params, f)
    return out


def checkpoints(tmp: str) -> dict[str, tuple[str, str]]:
    """{name: (target folder, draft folder)}."""
    import make_checkpoint
    from tokenizer import Tokenizer

    tokenizer = os.path.join(ROOT, "demo", "tokenizer.model")
    model = make_checkpoint.random_hf_model(768, 12, 12, 12, Tokenizer(tokenizer).n_words, seed=0)
    big = make_checkpoint.write_layouts(model, os.path.join(tmp, "110M"), tokenizer, ["meta:1"])["meta:1"]
    out = {}
    for name, folder in (("demo", os.path.join(ROOT, "demo")), ("110M", big)):
        out[name] = (folder, truncated(folder, DRAFT_LAYERS[name], os.path.join(tmp, f"{name}-draft")))
    return out


def load(folder: str, num_blocks: int | None = None):
    llama = llama2.tp_llama(None, folder, os.path.join(ROOT, "demo", "tokenizer.model"), 1, max_batch_size=8,
                            max_seq_len=512)
    if num_blocks:
        llama.runner.allocate(num_blocks=num_blocks)
    return llama


def run(llama, spec, prompts: list[list[int]], temperature: float, new: int) -> tuple[float, Speculation | None]:
    engine = Engine(llama.runner, llama.tokenizer, threaded=False, speculation=spec)
    seqs = [engine.add(p, SamplingParams(max_gen_len=new, temperature=temperature, top_p=1.0, seed=i,
                                         ignore_eos=True)) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    while engine.running:
        engine.step()
    return sum(len(s.tokens) for s in seqs) / (time.perf_counter() - start), spec


def step_ms(llama) -> float:
    """Median time of a batch-1 decode step at position 100 (eager), ms."""
    tokens = torch.zeros(1, 1, dtype=torch.long)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        llama.runner(tokens, 100)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows, costs = [], []
    with tempfile.TemporaryDirectory(prefix="spec_bench_") as tmp:
        for name, (target_dir, draft_dir) in checkpoints(tmp).items():
            target = load(target_dir)
            draft = load(draft_dir, target.runner.num_blocks)
            costs.append(f"{name}: a decode step {step_ms(target):.1f} ms, its draft's {step_ms(draft):.1f} ms")
            tok = target.tokenizer
            workloads = {w: [tok.encode(p, bos=True, eos=False) for p in texts]
                         for w, texts in (("grounded", GROUNDED), ("open", OPEN))}
            for workload, prompts in workloads.items():
                for batch in (1, 2, 4, 8):
                    for temperature in ((0.0, 0.7) if batch in (1, 8) else (0.0,)):
                        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
                        methods = {"off": lambda: None,
                                   "ngram": lambda: Speculation(NgramProposer(), K, 8, 512),
                                   "draft": lambda: Speculation(DraftProposer(draft.runner), K, 8, 512)}
                        speeds = {m: [] for m in methods}
                        specs = {}
                        for _ in range(a.rounds):
                            for m, make in methods.items():
                                speed, specs[m] = run(target, make(), batch_prompts, temperature, a.new)
                                speeds[m].append(speed)
                        off = statistics.median(speeds["off"])
                        cells = []
                        for m in ("ngram", "draft"):
                            s = specs[m]
                            rate = s.accepted / s.proposed if s.proposed else 0.0
                            cells.append(f"**{statistics.median(speeds[m]) / off:.2f}** | {rate:.0%} | "
                                         f"{s.mean_accepted:.2f}")
                        rows.append(f"| {name} | {workload} | {batch} | {temperature} | {off:.1f} | "
                                    + " | ".join(cells) + " |")
                        print(rows[-1], flush=True)
    text = f"""## Speculative decoding

`python bench/speculative.py {' '.join(sys.argv[1:])}` — {report.header()}; {a.rounds} rounds.

engine.Engine, TP=1, 1 thread, {a.new} new tokens per sequence (EOS off), top_p 1, k = {K} proposed tokens \
per step, speculating at every batch size here (the serving default steps aside above \
`handler.speculative.max_batch`). *demo*: the trained demo checkpoint; *110M*: bench/decode.py's random \
110M shape. Draft: the target's first {DRAFT_LAYERS['demo']} (demo) or {DRAFT_LAYERS['110M']} (110M) layers \
({'; '.join(costs)}). *grounded*: prompts that quote a passage and ask for it again (or a code edit); \
*open*: prompts that do not. *speed-up*: tokens/s against plain decoding in the same round (median); \
*accepted*: proposed tokens accepted; *per step*: tokens accepted per verifying step of a sequence.

| model | workload | batch | temperature | plain (tokens/s) | n-gram speed-up | accepted | per step | draft speed-up | accepted | per step |
|---|---|---|---|---|---|---|---|---|---|---|
""" + "\n".join(rows) + "\n"
    report.publish("speculative", text, not a.no_write)


if __name__ == "__main__":
    main()
