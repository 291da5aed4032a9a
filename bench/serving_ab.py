"""Serving speed of this tree against an earlier commit, through TorchServe, in one run:

    python bench/serving_ab.py [--baseline f9e32b2 | --speculative ngram] [--rounds 2] [--no-write]

Each round starts a private TorchServe (tools/local_server.py: TP=2, batchSize 8, the
handler's settings as configured) on the baseline's files (from `git archive`) and one on
this tree's, one after the other (which goes first alternates from round to round), on the
same random Llama (bench/serving_load.py's ~21M shape), after a warm-up server that is not
measured. Each server measures a single stream (128 new tokens, greedy, EOS off: its decode
tokens/s after the first token, median of 5) and 8 clients (64 streamed requests of 16-64
prompt and 64 new tokens: output tokens/s). The medians over rounds are compared, and so
are the two servers of each round (the median of the rounds' ratios). Writes its table
into BENCHMARKS.md (serving_ab). With --speculative METHOD, this tree with
handler.speculative.method METHOD against this tree without (serving_ab_speculative), and
the tokens proposed and accepted while the 8 clients ran.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import report
import serving_load as serving
from engine_workloads import read_gauge, served
from report import checkout

SINGLE = {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True, "stream": True}


def single_stream(target, prompt: str, reps: int = 5) -> float:
    target.send(SINGLE | {"prompt": prompt, "max_new_tokens": 8})  # first-call costs out of the way
    rates = []
    for _ in range(reps):
        r = target.send(SINGLE | {"prompt": prompt})
        rates.append((r.output_tokens - 1) / (r.latency - r.ttft))
    return statistics.median(rates)


def eight_clients(target, bodies: list[dict], seed: int) -> dict:
    serving.run_one_by_one(target, [b | {"max_new_tokens": 2} for b in bodies[:2]])  # warm-up
    results, duration = serving.run_load(target, bodies, 8, float("inf"), 0.0, seed)
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    summary = serving.summarize(results, duration)
    return {"clients8": summary["output_throughput"], "tokens8": sum(summary["output_tokens"])}


def proposals(server) -> dict:
    """The speculative counters a server's worker last recorded (0 without speculation)."""
    time.sleep(1)  # the last iteration's metrics reach the frontend through the worker's log
    return {name: read_gauge(server, f"Speculative{name.capitalize()}") or 0.0 for name in ("proposed", "accepted")}


def measure(server, prompt: str, bodies: list[dict], seed: int) -> dict:
    """Single-stream decode speed, then 8 clients' throughput and the tokens speculation
    proposed and accepted meanwhile."""
    target = serving.Target(server.url, server.key)
    m = {"single": single_stream(target, prompt)}
    before = proposals(server)
    m |= eight_clients(target, bodies, seed)
    return m | {f"{name}8": value - before[name] for name, value in proposals(server).items()}


def run(a) -> dict:
    prompts = serving.make_prompts(64, 16, 64, serving.TOKENIZER, a.seed)
    bodies = serving.request_bodies(prompts, 64, 0.6)
    runs = {"baseline": [], "this tree": []}
    with tempfile.TemporaryDirectory(prefix="bench_serving_ab_") as tmp:
        if a.speculative:
            servers = {"baseline": (serving.ROOT, None),
                       "this tree": (serving.ROOT, {"speculative": {"method": a.speculative}})}
        else:
            servers = {"baseline": (checkout(a.baseline, os.path.join(tmp, "baseline")), None),
                       "this tree": (serving.ROOT, None)}
        ckpt, _ = serving.write_checkpoint(os.path.join(tmp, "ckpt"), 512, 6, 8)
        # the first server started in a run is slower (files not yet in the page cache): not measured
        served(tmp, "warm-up", ckpt, lambda s: single_stream(serving.Target(s.url, s.key), prompts[0], reps=1),
               root=servers["baseline"][0])
        for i in range(a.rounds):
            order = list(servers.items())
            for name, (root, handler) in order[::-1] if i % 2 else order:  # a drift cancels out
                begin = time.perf_counter()
                m = served(tmp, f"{name.replace(' ', '_')}-{i}", ckpt,
                           lambda s: measure(s, prompts[0], bodies, a.seed), root=root, handler=handler)
                runs[name].append(m)
                print(f"round {i} {name}: {m} ({time.perf_counter() - begin:.0f} s)", file=sys.stderr)
    return runs


def section(a, runs: dict, argv: list[str]) -> str:
    def median(name, key):
        return statistics.median(m[key] for m in runs[name])

    against = (f"with handler.speculative.method {a.speculative} (*this tree*) against without (*baseline*)"
               if a.speculative else f"against {a.baseline}")
    title = "Serving speed with speculative decoding" if a.speculative else "Serving speed against an earlier commit"
    lines = [f"## {title}", "",
             f"`{' '.join(['python', 'bench/serving_ab.py'] + argv)}` — {report.header()}; this tree "
             f"{serving.revision()} {against}, {a.rounds} rounds (the two servers one after the other, "
             "in turn first), medians.", "",
             "| part | baseline | this tree | ratio of the medians | median of the rounds' ratios | "
             "each round (this tree / baseline) |", "|---|---|---|---|---|---|"]
    for key, title in (("single", "single stream, decode tokens/s"), ("clients8", "8 clients, output tokens/s")):
        base, ours = median("baseline", key), median("this tree", key)
        ratios = [o[key] / b[key] for o, b in zip(runs["this tree"], runs["baseline"])]
        each = ", ".join(f"{r:.3f}" for r in ratios)
        lines.append(f"| {title} | {base:.1f} | {ours:.1f} | {ours / base:.3f} | {statistics.median(ratios):.3f} | {each} |")
    if a.speculative:
        spec = runs["this tree"]
        lines += ["", "While the 8 clients ran, speculation proposed "
                  + ", ".join(f"{m['proposed8']:.0f}" for m in spec) + " tokens and had "
                  + ", ".join(f"{m['accepted8']:.0f}" for m in spec) + " accepted, of "
                  + ", ".join(f"{m['tokens8']}" for m in spec) + " output tokens (each round)."]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="f9e32b2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speculative", choices=["ngram"], help="this tree with this method against without")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    name = "serving_ab_speculative" if a.speculative else "serving_ab"
    report.publish(name, section(a, run(a), sys.argv[1:]), write=not a.no_write)


if __name__ == "__main__":
    main()
