"""Speculative decoding against plain decoding, on the same machine in one run:

    python bench/speculative.py [--models demo 110M] [--batches 1 2 4 8] [--rounds 3] [--new 64] [--k 4]
                                [--policy] [--no-write]

engine.Engine at TP=1, 1 thread, on up to three models: the demo checkpoint (trained:
acceptance as text gives it); bench/decode.py's 110M shape (random fp32 weights, seed 0:
the step costs of a larger model; a random model's greedy text soon repeats itself, so its
acceptance says little about real text); *copier*, the 110M shape with tools/copier.py's
weights, which continue a passage seen earlier in the prompt and otherwise make text that
does not repeat (what prompt lookup gains where a model quotes its input, and loses where
nothing repeats). Draft models: the target's own first layers (its
embeddings, final norm and output kept: an early-exit draft), written as a checkpoint of
their own. Workloads: *grounded*, prompts that quote a passage and ask for it again;
*open*, prompts that do not. Each configuration: batch sequences of `--new` tokens, EOS
off; tokens/s = tokens / wall time of the whole run (prefill included), median over the
rounds, each round running every method in turn; greedy outputs are compared with plain
decoding's. Writes its table into BENCHMARKS.md (a section of its own for other --models).

With --policy, greedy only: plain decoding against n-gram speculation under the serving
default (handler.speculative.max_batch), which steps aside at batch sizes above it, so that
what remains is its bookkeeping's cost (section speculative-policy).
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
from serving_config import Speculative  # noqa: E402
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
MODELS = {"demo": "the trained demo checkpoint", "110M": "bench/decode.py's random 110M shape",
          "copier": "the 110M shape with tools/copier.py's weights (quotes what its prompt holds)"}
DEFAULT_MODELS = ["demo", "110M"]  # the "speculative" section's; other choices get a section of their own
# a quarter of the layers; the copier's first two hold its whole circuit (tools/copier.py)
DRAFT_LAYERS = {"demo": 2, "110M": 3, "copier": 2}


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


def target_folder(name: str, tmp: str) -> str:
    """The folder of a model named in MODELS."""
    import copier
    import make_checkpoint
    from tokenizer import Tokenizer

    if name == "demo":
        return os.path.join(ROOT, "demo")
    path = os.path.join(ROOT, "demo", "tokenizer.model")
    tokenizer = Tokenizer(path)
    if name == "copier":
        return copier.write(os.path.join(tmp, name), 768, 12, 12, tokenizer.n_words, tokenizer.bos_id)
    model = make_checkpoint.random_hf_model(768, 12, 12, 12, tokenizer.n_words, seed=0)
    return make_checkpoint.write_layouts(model, os.path.join(tmp, name), path, ["meta:1"])["meta:1"]


def checkpoints(names: list[str], tmp: str) -> dict[str, tuple[str, str]]:
    """{name: (target folder, draft folder)}."""
    out = {}
    for name in names:
        folder = target_folder(name, tmp)
        out[name] = (folder, truncated(folder, DRAFT_LAYERS[name], os.path.join(tmp, f"{name}-draft")))
    return out


def workloads(tokenizer, batch: int) -> dict[str, list[list[int]]]:
    """{workload: batch prompts' tokens}, the workload's prompts repeated to fill the batch."""
    out = {}
    for name, texts in (("grounded", GROUNDED), ("open", OPEN)):
        prompts = [tokenizer.encode(p, bos=True, eos=False) for p in texts]
        out[name] = [prompts[i % len(prompts)] for i in range(batch)]
    return out


def load(folder: str, num_blocks: int | None = None):
    llama = llama2.tp_llama(None, folder, os.path.join(ROOT, "demo", "tokenizer.model"), 1, max_batch_size=8,
                            max_seq_len=512)
    if num_blocks:
        llama.runner.allocate(num_blocks=num_blocks)
    return llama


def run(llama, spec, prompts: list[list[int]], temperature: float, new: int) -> tuple[float, list[list[int]]]:
    """Tokens/s, and each sequence's tokens."""
    engine = Engine(llama.runner, llama.tokenizer, threaded=False, speculation=spec)
    seqs = [engine.add(p, SamplingParams(max_gen_len=new, temperature=temperature, top_p=1.0, seed=i,
                                         ignore_eos=True)) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    while engine.running:
        engine.step()
    return sum(len(s.tokens) for s in seqs) / (time.perf_counter() - start), [s.tokens for s in seqs]


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
    ap.add_argument("--k", type=int, default=4, help="most tokens a sequence proposes per step")
    ap.add_argument("--models", nargs="+", choices=MODELS, default=DEFAULT_MODELS)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--policy", action="store_true", help="greedy, plain against n-gram under the serving default")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.policy:
        return policy(a)
    rows, costs, differing = [], [], []
    with tempfile.TemporaryDirectory(prefix="spec_bench_") as tmp:
        for name, (target_dir, draft_dir) in checkpoints(a.models, tmp).items():
            target = load(target_dir)
            draft = load(draft_dir, target.runner.num_blocks)
            costs.append(f"{name}: a decode step {step_ms(target):.1f} ms, its draft's {step_ms(draft):.1f} ms")
            for workload in ("grounded", "open"):
                for batch in a.batches:
                    batch_prompts = workloads(target.tokenizer, batch)[workload]
                    for temperature in ((0.0, 0.7) if batch in (1, 8) else (0.0,)):
                        methods = {"off": lambda: None,
                                   "ngram": lambda: Speculation(NgramProposer(), a.k, 8, 512),
                                   "draft": lambda: Speculation(DraftProposer(draft.runner), a.k, 8, 512)}
                        speeds = {m: [] for m in methods}
                        specs = {}
                        for _ in range(a.rounds):
                            outputs = {}
                            for m, make in methods.items():
                                specs[m] = make()
                                speed, outputs[m] = run(target, specs[m], batch_prompts, temperature, a.new)
                                speeds[m].append(speed)
                            differing += [f"{name} {workload} batch {batch} {m}" for m in ("ngram", "draft")
                                          if temperature == 0 and outputs[m] != outputs["off"]]
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
    own = a.models != DEFAULT_MODELS
    drafts = ", ".join(f"{DRAFT_LAYERS[m]} ({m})" for m in a.models)
    greedy = ("Greedy outputs with speculation differ from plain decoding's in: " + "; ".join(differing) if differing
              else "Greedy outputs with speculation equal plain decoding's in every greedy run")
    text = f"""## Speculative decoding{': ' + ', '.join(a.models) if own else ''}

`python bench/speculative.py {' '.join(sys.argv[1:])}` — {report.header()}; {a.rounds} rounds.

engine.Engine, TP=1, 1 thread, {a.new} new tokens per sequence (EOS off), top_p 1, k = {a.k} proposed tokens \
per step, speculating at every batch size here (the serving default steps aside above \
`handler.speculative.max_batch`). {'; '.join(f'*{m}*: {MODELS[m]}' for m in a.models)}. Draft: the \
target's first {drafts} layers ({'; '.join(costs)}). *grounded*: prompts that quote a passage and ask for \
it again (or a code edit); *open*: prompts that do not. *speed-up*: tokens/s against plain decoding in the \
same round (median); *accepted*: proposed tokens accepted; *per step*: tokens accepted per verifying step \
of a sequence. {greedy}.

| model | workload | batch | temperature | plain (tokens/s) | n-gram speed-up | accepted | per step | draft speed-up | accepted | per step |
|---|---|---|---|---|---|---|---|---|---|---|
""" + "\n".join(rows) + "\n"
    report.publish("speculative" + "".join(f"-{m}" for m in a.models if own), text, not a.no_write)


def bookkeeping_us(llama, prompts: list[list[int]], k: int, max_batch: int, calls: int = 10000) -> float:
    """What the policy adds to a step where it steps aside: Speculation.reserve and propose
    over the step's sequences, microseconds per step."""
    engine = Engine(llama.runner, llama.tokenizer, threaded=False)
    seqs = [engine.add(p, SamplingParams(max_gen_len=64)) for p in prompts]
    spec = Speculation(NgramProposer(), k, max_batch, 512)
    start = time.perf_counter()
    for _ in range(calls):
        spec.reserve(seqs)
        spec.propose(seqs)
    return (time.perf_counter() - start) / calls * 1e6


def policy(a):
    """Greedy tokens/s of n-gram speculation under the serving default's max_batch against
    plain decoding, the two alternating, and the tokens it proposed."""
    max_batch = Speculative().max_batch
    rows = []
    with tempfile.TemporaryDirectory(prefix="spec_bench_") as tmp:
        for name in a.models:
            target = load(target_folder(name, tmp))
            for workload in ("grounded", "open"):
                for batch in a.batches:
                    batch_prompts = workloads(target.tokenizer, batch)[workload]
                    speeds = {"off": [], "policy": []}
                    proposed = 0
                    for _ in range(a.rounds):
                        spec = Speculation(NgramProposer(), a.k, max_batch, 512)
                        for m, s in (("off", None), ("policy", spec)):
                            speeds[m].append(run(target, s, batch_prompts, 0.0, a.new)[0])
                        proposed += spec.proposed
                    ratios = [p / o for p, o in zip(speeds["policy"], speeds["off"])]
                    plain = statistics.median(speeds["off"])
                    extra = bookkeeping_us(target, batch_prompts, a.k, max_batch)
                    rows.append(f"| {name} | {workload} | {batch} | {plain:.1f} | "
                                f"**{statistics.median(ratios):.3f}** | {min(ratios):.3f}–{max(ratios):.3f} | "
                                f"{proposed / a.rounds:.0f} | {extra:.1f} µs ({extra / 1e4 * plain / batch:.4f} %) |")
                    print(rows[-1], flush=True)
    text = f"""## Speculative decoding: the serving policy

`python bench/speculative.py {' '.join(sys.argv[1:])}` — {report.header()}; {a.rounds} rounds.

engine.Engine, TP=1, 1 thread, greedy, {a.new} new tokens per sequence (EOS off): plain decoding against \
n-gram speculation (k = {a.k}) under the serving default `handler.speculative.max_batch` {max_batch}, which \
proposes nothing while more than {max_batch} sequences decode, the two alternating in each round. \
{'; '.join(f'*{m}*: {MODELS[m]}' for m in a.models)}. *ratio*: the median of the rounds' tokens/s ratios \
(policy / plain); *proposed*: tokens proposed per run (mean); *bookkeeping*: what the policy adds to a \
step that it steps aside from (deciding that no sequence proposes), timed alone, and its share of a plain \
step (batch / plain tokens/s).

| model | workload | batch | plain (tokens/s) | ratio | rounds' range | proposed | bookkeeping per step |
|---|---|---|---|---|---|---|---|
""" + "\n".join(rows) + "\n"
    report.publish("speculative-policy", text, not a.no_write)


if __name__ == "__main__":
    main()
