"""The serving engine's workloads, each against a reference measured in the same run, on
private TorchServes (tools/local_server.py) serving one random Llama (TP=2 on CPU):

    python bench/serving_load.py --engine [--baseline COMMIT] [--parts today shared memory long sweep single]

- today: 64 streamed requests without a shared prefix, 8 clients (bench/serving_load.py's load,
  idle and busy TTFT) on the baseline (the engine before the paged KV cache: --baseline,
  built from that commit), on this engine with its steps overlapping TorchServe's round
  trip, one per iteration (handler.overlap true: a GPU's default), and on this engine as
  configured (handler.overlap auto: on this CPU, unless a core is left over, serving_config.py's
  IN_TURN_STEPS and IN_TURN_SECONDS, in turn with the round trip).
- shared: 64 chat requests sharing a 512-token system prompt, 32-token user turns, 8
  clients: prefix caching on against off.
- memory: 48-token prompts and 48 new tokens, 32 clients, with the baseline's KV memory
  (8 rows of 512 tokens): this engine at batchSize 32 (and kv_cache_bytes of 8 x 512
  tokens) against the baseline at batchSize 8; the most sequences decoding at once is
  read from the SequencesRunning gauge.
- long: a 2,000-token prompt arriving while 8 streams decode: those streams' inter-token
  latencies, p99 against median, on this engine and the baseline.
- sweep: output tokens/s and median TTFT against concurrency 1-16, this engine and the
  baseline; a PNG.
- single: one streamed request of 128 tokens through TorchServe (as configured, and
  overlapped with one step per iteration) against the in-process Engine on the same weights
  and settings, the two alternating after the server's warm-up, TP=1 (2 threads) and TP=2
  (1 thread per rank), for the 26M and 110M shapes of bench/decode.py.
"""

import itertools
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import requests

import report
from report import checkout
import serving_load as serving
import collectives
from serving_config import IN_TURN_SECONDS, IN_TURN_STEPS, default_token_budget

ROOT = serving.ROOT
SHAPES = {"26M": (512, 8, 8), "110M": (768, 12, 12)}  # dim, layers, heads: bench/decode.py's
IN_TURN = f"{IN_TURN_STEPS[0]} steps per iteration or more in {IN_TURN_SECONDS * 1000:.0f} ms"  # the CPU default


# --- servers --------------------------------------------------------------------------------

def start(tmp: str, name: str, ckpt: str, root: str = ROOT, tp: int = 2, batch_size: int = 8,
          handler: dict | None = None, threads: int | None = None):
    from local_server import start_server

    workdir = os.path.join(tmp, name)
    os.makedirs(workdir)
    return start_server(workdir, ckpt, tp=tp, batch_size=batch_size, handler=handler, root=root, threads=threads)


def served(tmp, name, ckpt, run, **server):
    """run(server) on a server that is stopped afterwards."""
    srv = start(tmp, name, ckpt, **server)
    try:
        return run(srv)
    finally:
        srv.stop()


def read_gauge(server, name: str) -> float | None:
    """A Prometheus gauge's value on a server now; None before the worker has recorded it."""
    text = requests.get(server.metrics_url, timeout=5).text
    m = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    return float(m[1]) if m else None


class Gauge(threading.Thread):
    """The highest value a Prometheus gauge of a server shows while it runs."""

    def __init__(self, server, name: str):
        super().__init__(daemon=True)
        self.server, self.name, self.peak, self.running = server, name, 0.0, True

    def run(self):
        while self.running:
            try:
                self.peak = max(self.peak, read_gauge(self.server, self.name) or 0.0)
            except requests.RequestException:
                pass
            time.sleep(0.2)

    def stop(self) -> float:
        self.running = False
        self.join()
        return self.peak


# --- workloads ----------------------------------------------------------------------------

OVERLAPPED = "engine, overlapped, 1 step per iteration"
OVERLAP_1 = {"overlap": True, "steps_per_iteration": 1}

def load(server, bodies, concurrency: int, seed: int = 0) -> dict:
    target = serving.Target(server.url, server.key)
    serving.run_one_by_one(target, [b | {"max_new_tokens": 2} for b in bodies[:2]])  # warm-up
    results, duration = serving.run_load(target, bodies, concurrency, float("inf"), 0.0, seed)
    return serving.summarize(results, duration)


def today(a, tmp, ckpt, baseline, bodies) -> dict:
    out = {}
    for name, server in (("baseline", {"root": baseline}), (OVERLAPPED, {"handler": OVERLAP_1}),
                         ("engine", {})):
        out[name] = served(tmp, f"today-{len(out)}", ckpt, lambda s: serving.measure(
            serving.Target(s.url, s.key), bodies, a, s), **server)
    return out


def text_of(n_tokens: int) -> str:
    """English text of n_tokens tokens (bench/serving_load.py's prose, repeated)."""
    tok = tokenizer()
    ids = tok.encode(" ".join([serving.PROSE] * (1 + n_tokens // 500)), bos=False, eos=False)
    return tok.decode(ids[:n_tokens])


def system_prompt_bodies(a, n: int = 64) -> list[dict]:
    system = text_of(512)
    turns = serving.make_prompts(n, 32, 32, serving.TOKENIZER, a.seed + 1)
    return [{"dialog": [{"role": "system", "content": system}, {"role": "user", "content": t}],
             "max_new_tokens": 32, "temperature": a.temperature, "seed": i, "stream": True}
            for i, t in enumerate(turns)]


def shared(a, tmp, ckpt) -> dict:
    bodies = system_prompt_bodies(a)
    return {caching: served(tmp, f"shared-{caching}", ckpt, lambda s: load(s, bodies, 8),
                            handler={"prefix_caching": caching, "max_seq_len": 1024})
            for caching in (True, False)}


def memory(a, tmp, ckpt, baseline) -> dict:
    prompts = serving.make_prompts(96, 48, 48, serving.TOKENIZER, a.seed + 2)
    bodies = serving.request_bodies(prompts, 48, a.temperature)

    def run(server):
        gauge = Gauge(server, "SequencesRunning")
        gauge.start()
        m = load(server, bodies, 32)
        return m | {"peak_running": gauge.stop()}

    probe = start(tmp, "memory-probe", ckpt, batch_size=8, handler={"max_seq_len": 512})
    block_bytes = 8 * 512 * kv_token_bytes(probe)
    probe.stop()
    return {"engine": served(tmp, "memory-engine", ckpt, run, batch_size=32,
                             handler={"max_seq_len": 512, "kv_cache_bytes": block_bytes}),
            "baseline": served(tmp, "memory-baseline", ckpt, lambda s: load(s, bodies, 32), root=baseline,
                               batch_size=8, handler={"max_seq_len": 512}),
            "kv_cache_bytes": block_bytes}


def kv_token_bytes(server) -> int:
    """KV-cache bytes per token on a rank, from the handler's log line."""
    import re

    m = re.search(r"KV cache: (\d+) blocks of (\d+) tokens \(([\d.]+) MB", server.log())
    return round(float(m[3]) * 1e6 / (int(m[1]) * int(m[2])))


def long_prompt(a, tmp, ckpt, baseline) -> dict:
    """8 streams decoding; a 2,000-token prompt arrives; the streams' inter-token latencies."""
    long_body = {"prompt": text_of(2000), "max_new_tokens": 8, "temperature": 0, "stream": True}
    prompts = serving.make_prompts(8, 32, 48, serving.TOKENIZER, a.seed + 3)
    background = serving.request_bodies(prompts, 160, a.temperature)

    def run(server):
        target = serving.Target(server.url, server.key)
        serving.run_one_by_one(target, [background[0] | {"max_new_tokens": 2}])
        results = [None] * 8
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, target.send(background[i])))
                   for i in range(8)]
        for t in threads:
            t.start()
            time.sleep(0.1)
        time.sleep(2.0)  # all 8 decoding
        long = target.send(long_body)
        for t in threads:
            t.join()
        gaps = [g for res in results if res and not res.error for g in res.itl]
        return {"itl": serving.stats(gaps), "long_prompt_tokens": long.prompt_tokens, "long_ttft": long.ttft,
                "long_latency": long.latency, "errors": [res.error for res in results + [long] if res and res.error]}

    handler = {"max_seq_len": 2304}
    budget = {"max_batched_tokens": a.long_budget} if a.long_budget is not None else {}
    return {"engine": served(tmp, "long-engine", ckpt, run, batch_size=9, handler=handler | budget),
            "baseline": served(tmp, "long-baseline", ckpt, run, root=baseline, batch_size=9, handler=handler)}


def sweep(a, tmp, ckpt, baseline, bodies) -> dict:
    levels = [1, 2, 4, 8, 16]

    def run(server):
        return {c: load(server, bodies[:max(16, 4 * c)], c) for c in levels}

    return {"engine": served(tmp, "sweep-engine", ckpt, run, batch_size=16),
            "baseline": served(tmp, "sweep-baseline", ckpt, run, root=baseline, batch_size=16)}


def plot(result: dict, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, runs in result.items():
        levels = sorted(runs)
        ax1.plot(levels, [runs[c]["output_throughput"] for c in levels], marker="o", label=name)
        ax2.plot(levels, [runs[c]["ttft"]["median"] for c in levels], marker="o", label=name)
    ax1.set(xlabel="concurrent clients", ylabel="output tokens/s", xscale="log", title="Throughput")
    ax2.set(xlabel="concurrent clients", ylabel="median TTFT (ms)", xscale="log", yscale="log", title="Time to first token")
    for ax in (ax1, ax2):
        ax.set_xticks([1, 2, 4, 8, 16], ["1", "2", "4", "8", "16"])
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# --- single: TorchServe against the in-process engine -----------------------------------------

SINGLE_NEW = 128
SINGLE_WARM_S = 20  # a new frontend's JIT compiles for its first ~20 s of streams
SINGLE_PAIRS = 9  # a stream through the server, then a sequence in-process: both meet the same machine


def single(a, tmp) -> dict:
    out = {}
    for shape, (dim, layers, heads) in SHAPES.items():
        ckpt, _ = serving.write_checkpoint(os.path.join(tmp, f"single-{shape}"), dim, layers, heads)
        for tp, threads in ((1, 2), (2, 1)):
            body = {"prompt": serving.make_prompts(1, 32, 32, serving.TOKENIZER, a.seed)[0],
                    "max_new_tokens": SINGLE_NEW, "temperature": 0, "ignore_eos": True, "stream": True}

            def run(server):
                target = serving.Target(server.url, server.key)
                with InProcessEngine(ckpt, tp, threads, tmp) as alone:
                    warm_until = time.time() + SINGLE_WARM_S
                    while time.time() < warm_until:
                        target.send(body)
                    rates, in_process, wall, begin = [], [], 0.0, time.time()
                    for _ in range(SINGLE_PAIRS):
                        r = target.send(body)
                        rates.append((r.output_tokens - 1) / (r.latency - r.ttft))
                        wall += r.latency
                        in_process.append(alone.decode())
                time.sleep(1)  # the last log lines
                return {"tokens_per_s": statistics.median(rates), "in_process": statistics.median(in_process),
                        "wall": wall, "server": serving.iterations(server, begin, time.time())}

            m = served(tmp, f"single-{shape}-tp{tp}", ckpt, run, tp=tp, batch_size=8, threads=threads)
            overlapped = served(tmp, f"single-{shape}-tp{tp}-overlapped", ckpt, run, tp=tp, batch_size=8,
                                threads=threads, handler=OVERLAP_1)
            out[(shape, tp)] = {"in_process": m["in_process"], "torchserve": m["tokens_per_s"],
                                "overlapped": overlapped["tokens_per_s"],
                                "overlapped_in_process": overlapped["in_process"],
                                "as configured": breakdown(m), "overlapped, 1 step": breakdown(overlapped)}
    return out


def breakdown(m: dict) -> dict:
    return {"wall_ms": m["wall"] * 1000 / max(m["server"]["iterations"], 1)} | m["server"]


class InProcessEngine:
    """The Engine on the same weights, in this process's image of a rank: torchrun with tp
    ranks and threads threads each, kept running; decode() has it decode one sequence and
    returns its tokens/s from its first token to its last. The ranks wait (polling a folder)
    while the server streams."""

    def __init__(self, ckpt: str, tp: int, threads: int, tmp: str):
        folder = tempfile.mkdtemp(prefix="in-process-", dir=tmp)
        self.folder, self.n = folder, 0
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=ROOT)
        self.proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                      f"--nproc-per-node={tp}", __file__, "--in-process", ckpt, folder], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def decode(self) -> float:
        self.n += 1
        open(os.path.join(self.folder, f"go{self.n}"), "w").close()
        result = os.path.join(self.folder, f"rate{self.n}")
        while not os.path.exists(result):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the in-process engine exited ({self.proc.returncode})")
            time.sleep(0.01)
        with open(result) as f:
            return float(f.read())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        open(os.path.join(self.folder, "quit"), "w").close()
        self.proc.wait(timeout=60)


def in_process_rank(ckpt: str, folder: str):
    """InProcessEngine's ranks: a sequence to warm up, then one for each go<n> file in folder,
    until a quit file; rank 0 writes each one's rate to rate<n>."""
    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    import llama2
    from engine import Engine
    from sequence import SamplingParams

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank0 = int(os.environ.get("RANK", "0")) == 0
    llama = llama2.tp_llama(None, ckpt, None, world_size, max_batch_size=8, max_seq_len=512)
    prompt = llama.tokenizer.encode(serving.make_prompts(1, 32, 32, serving.TOKENIZER, 0)[0], bos=True, eos=False)
    engine = Engine(llama.runner, llama.tokenizer)

    def decode(n: int) -> float:
        seq = engine.add(prompt, SamplingParams(max_gen_len=n, temperature=0, ignore_eos=True))
        engine.step()  # the prefill and the first token
        begin = time.perf_counter()
        while not seq.done:
            engine.step()
        return (len(seq.tokens) - 1) / (time.perf_counter() - begin)

    decode(8)
    for n in itertools.count(1):
        while not os.path.exists(os.path.join(folder, f"go{n}")):
            if os.path.exists(os.path.join(folder, "quit")):
                if dist.is_initialized():
                    dist.destroy_process_group()
                return
            time.sleep(0.01)
        rate = decode(SINGLE_NEW)
        if rank0:
            with open(os.path.join(folder, "rate.tmp"), "w") as f:
                f.write(repr(rate))
            os.replace(os.path.join(folder, "rate.tmp"), os.path.join(folder, f"rate{n}"))


# --- the report ------------------------------------------------------------------------------

def tokenizer():
    from tokenizer import Tokenizer

    return Tokenizer(serving.TOKENIZER)


def run_parts(a) -> dict:
    result = {"revision": serving.revision(), "baseline": a.baseline}
    bodies = serving.request_bodies(serving.make_prompts(a.num_requests, *a.prompt_tokens, serving.TOKENIZER,
                                                         a.seed), a.max_new_tokens, a.temperature)
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        baseline = checkout(a.baseline, os.path.join(tmp, "baseline"))
        ckpt, model = serving.write_checkpoint(os.path.join(tmp, "ckpt"), a.dim, a.layers, a.heads)
        result["model"] = model
        parts = {"today": lambda: today(a, tmp, ckpt, baseline, bodies), "shared": lambda: shared(a, tmp, ckpt),
                 "memory": lambda: memory(a, tmp, ckpt, baseline), "long": lambda: long_prompt(a, tmp, ckpt, baseline),
                 "sweep": lambda: sweep(a, tmp, ckpt, baseline, bodies), "single": lambda: single(a, tmp)}
        for name in a.parts:
            begin = time.perf_counter()
            result[name] = parts[name]()
            print(f"part {name}: {time.perf_counter() - begin:.0f} s", file=sys.stderr)
    return result


if __name__ == "__main__" and sys.argv[1:2] == ["--in-process"]:
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]
    in_process_rank(sys.argv[2], sys.argv[3])


def collectives_used() -> str:
    if collectives.requested() == "shm":
        return "through shared memory (the default)"
    return "through gloo (LLAMA_CPU_COLLECTIVES=gloo)"


def ratio(x: float, y: float) -> str:
    return f"{x / y:.2f}×"


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def today_table(runs: dict) -> str:
    lines = ["| server | output tokens/s, 8 clients | TTFT median: idle / busy (random arrivals) (ms) | "
             "ITL median / p99 (ms) | iterations | tokens per iteration |", "|---|---|---|---|---|---|"]
    for name, m in runs.items():
        load_, idle = m["load"], m["idle"]
        it = load_["server"]["iterations"]
        lines.append(f"| {name} | {load_['output_throughput']:.1f} | {idle['ttft']['median']:.0f} / "
                     f"{m['probe_ttft']['median']:.0f} | {load_['itl']['median']:.0f} / {load_['itl']['p99']:.0f} | "
                     f"{it} | {sum(load_['output_tokens']) / max(it, 1):.2f} |")
    return "\n".join(lines)


def section(a, r: dict, argv: list[str]) -> str:
    import ts

    model = r["model"]
    out = [f"""## Serving engine: paged KV cache, prefix caching, chunked prefill, steps per iteration

`{' '.join(['python', 'bench/serving_load.py'] + argv)}` — {report.header()}, TorchServe {ts.__version__}; commit \
{r['revision']}; baseline: commit {r['baseline']} (the engine before the paged KV cache, one KV-cache row per \
request, one prefill per admission, one step per iteration), built into its own archive and served the same way.

Model: random Llama, {model['parameters']:,} parameters (dim {model['dim']}, {model['n_layers']} layers, \
{model['n_heads']} heads), float32, demo vocabulary; TP=2 on CPU (1 thread per rank; this tree's \
collectives {collectives_used()}, the baseline's through gloo) unless a part says otherwise; \
streamed requests (native API), temperature {a.temperature} with a seed per request. One server at a time; every \
ratio compares servers measured in this run.
"""]
    if "today" in r:
        t = r["today"]
        base, over, eng = t["baseline"], t[OVERLAPPED], t["engine"]
        tp = lambda m: m["load"]["output_throughput"]  # noqa: E731
        out.append(f"""### No shared prefix: {a.num_requests} requests of {a.prompt_tokens[0]}–{a.prompt_tokens[1]} prompt tokens and {a.max_new_tokens} new tokens, {a.concurrency} clients (batchSize 8)

{today_table(t)}

- The engine as configured (here: {IN_TURN}, in turn with TorchServe's round trip) against the \
baseline: output tokens/s {ratio(tp(eng), tp(base))} (target ≥ 1.2×: {verdict(tp(eng) >= 1.2 * tp(base))}); idle TTFT median \
{ratio(eng['idle']['ttft']['median'], base['idle']['ttft']['median'])} the baseline's (target ≤ 1×: \
{verdict(eng['idle']['ttft']['median'] <= base['idle']['ttft']['median'])}); busy TTFT median \
{ratio(eng['probe_ttft']['median'], base['probe_ttft']['median'])} (target ≤ 1.5×: \
{verdict(eng['probe_ttft']['median'] <= 1.5 * base['probe_ttft']['median'])}).
- Overlapped, one step per iteration (a GPU's default), against the baseline: output tokens/s \
{ratio(tp(over), tp(base))}, idle TTFT median {ratio(over['idle']['ttft']['median'], base['idle']['ttft']['median'])}, \
busy TTFT median {ratio(over['probe_ttft']['median'], base['probe_ttft']['median'])}: on a CPU whose cores all \
compute, TorchServe's work during a step takes cores from the ranks.
""")
    if "shared" in r:
        on, off = r["shared"][True], r["shared"][False]
        speedup = ratio(on["output_throughput"], off["output_throughput"])
        out.append(f"""### Shared system prompt: 64 chat requests, one 512-token system prompt, 32-token user turns, 32 new tokens, 8 clients

| prefix caching | output tokens/s | TTFT mean / median / p99 (ms) | ITL median (ms) |
|---|---|---|---|
| on | {on['output_throughput']:.1f} | {serving.ms3(on['ttft'])} | {on['itl']['median']:.0f} |
| off | {off['output_throughput']:.1f} | {serving.ms3(off['ttft'])} | {off['itl']['median']:.0f} |

- Median TTFT {off['ttft']['median'] / on['ttft']['median']:.2f}× lower with prefix caching (target ≥ 3×: \
{verdict(off['ttft']['median'] >= 3 * on['ttft']['median'])}); output tokens/s {speedup} (target ≥ 1.5×: \
{verdict(on['output_throughput'] >= 1.5 * off['output_throughput'])}).
""")
    if "memory" in r:
        m = r["memory"]
        e, b = m["engine"], m["baseline"]
        out.append(f"""### Memory: the baseline's KV memory (8 rows of 512 tokens: {m['kv_cache_bytes'] / 1e6:.1f} MB per rank), 96 requests of 48 prompt and 48 new tokens, 32 clients

| server | most sequences decoding together | output tokens/s | TTFT median (ms) | ITL median (ms) |
|---|---|---|---|---|
| engine, batchSize 32, kv_cache_bytes {m['kv_cache_bytes']} | {e['peak_running']:.0f} | {e['output_throughput']:.1f} | {e['ttft']['median']:.0f} | {e['itl']['median']:.0f} |
| baseline, batchSize 8 | 8 (its rows) | {b['output_throughput']:.1f} | {b['ttft']['median']:.0f} | {b['itl']['median']:.0f} |

- {e['peak_running']:.0f} sequences decoded together in the same memory (target ≥ 32: \
{verdict(e['peak_running'] >= 32)}); output tokens/s {ratio(e['output_throughput'], b['output_throughput'])} \
(target ≥ 1.5×: {verdict(e['output_throughput'] >= 1.5 * b['output_throughput'])}).
""")
    if "long" in r:
        e, b = r["long"]["engine"], r["long"]["baseline"]
        out.append(f"""### A {e['long_prompt_tokens']}-token prompt arriving while 8 streams decode (160 new tokens each)

| server | the 8 streams' ITL median / p99 (ms) | p99 / median | the long prompt's TTFT / latency (s) |
|---|---|---|---|
| engine (max_batched_tokens {a.long_budget if a.long_budget is not None else f"auto: {default_token_budget(9, False)}"}) | {e['itl']['median']:.0f} / {e['itl']['p99']:.0f} | {e['itl']['p99'] / e['itl']['median']:.2f} | {e['long_ttft']:.1f} / {e['long_latency']:.1f} |
| baseline | {b['itl']['median']:.0f} / {b['itl']['p99']:.0f} | {b['itl']['p99'] / b['itl']['median']:.2f} | {b['long_ttft']:.1f} / {b['long_latency']:.1f} |

- p99 inter-token latency {e['itl']['p99'] / e['itl']['median']:.2f}× the median (target ≤ 3×: \
{verdict(e['itl']['p99'] <= 3 * e['itl']['median'])}); the baseline prefills the whole prompt in one step: \
{b['itl']['p99'] / b['itl']['median']:.2f}×.
""")
    if "sweep" in r:
        plot(r["sweep"], os.path.join(ROOT, "bench", "serving_concurrency.png"))
        rows = "\n".join(f"| {c} | " + " | ".join(f"{r['sweep'][n][c]['output_throughput']:.1f} / "
                                                    f"{r['sweep'][n][c]['ttft']['median']:.0f}"
                                                    for n in ("engine", "baseline")) + " |"
                         for c in sorted(r["sweep"]["engine"]))
        out.append(f"""### Throughput and TTFT against concurrency (batchSize 16; the same requests as above)

![output tokens/s and median TTFT against concurrent clients](bench/serving_concurrency.png)

| clients | engine: output tokens/s / TTFT median (ms) | baseline: output tokens/s / TTFT median (ms) |
|---|---|---|
{rows}
""")
    if "single" in r:
        rows = "\n".join(f"| {shape} | {tp} ({'2 threads' if tp == 1 else '1 thread per rank'}) | "
                         f"{v['torchserve']:.1f} | {v['in_process']:.1f} | {v['torchserve'] / v['in_process']:.2f} | "
                         f"{v['overlapped']:.1f} | {v['overlapped_in_process']:.1f} | "
                         f"{v['overlapped'] / v['overlapped_in_process']:.2f} |"
                         for (shape, tp), v in r["single"].items())
        ok = all(v["torchserve"] >= 0.9 * v["in_process"] for v in r["single"].values())
        parts = "\n".join(
            f"| {shape} | {tp} | {mode} | {b['iterations']} | {b['steps']:.2f} | {b['wall_ms']:.1f} | "
            f"{b['engine_ms']:.1f} | {b['wall_ms'] - b['engine_ms']:.1f} | {b['wall_ms'] - b['handler_ms']:.1f} | "
            f"{b['handler_ms']:.1f} | {b['engine_ms'] / b['steps']:.1f} | {1000 / v[alone]:.1f} |"
            for (shape, tp), v in r["single"].items()
            for mode, alone in (("as configured", "in_process"), ("overlapped, 1 step", "overlapped_in_process"))
            for b in [v[mode]])
        out.append(f"""### One streamed request through TorchServe against the in-process Engine ({SINGLE_NEW} new tokens, first to last)

Each server first streams for {SINGLE_WARM_S} s (a new frontend's JIT compiler works hardest then), while the \
in-process Engine loads (torchrun, the same ranks and threads, kept running); then {SINGLE_PAIRS} pairs: a stream \
through the server, then a sequence in-process, each idle while the other decodes. Medians over the pairs; \
pairing gives both the same machine, whose speed drifts by 20 % within minutes here.

| model | TP | TorchServe tokens/s, as configured (here: {IN_TURN}, in turn) | in-process Engine tokens/s, alternating with it | ratio | TorchServe, overlapped, 1 step per iteration | in-process, alternating with it | ratio, overlapped |
|---|---|---|---|---|---|---|---|
{rows}

- Every ratio as configured ≥ 0.9 (target): {verdict(ok)}.

Where an iteration's time goes (the same runs; means over the iterations of the timed requests, from \
ts_log.log: TorchServe's HandlerTime and the handler's EngineTime and EngineSteps gauges). In turn, handle() runs \
the steps and TorchServe's round trip follows; overlapped, the round trip runs during the steps, and handle() \
waits for them, then reads the batch, answers and starts the next ones:

| model | TP | server | iterations | engine steps per iteration | wall time per iteration (ms) | engine.run() (model steps, scheduling, sampling, text) | not covered by the steps (wall − engine.run) | TorchServe's round trip outside handle() (frontend, sockets, protocol) | handle() | per step | in-process step (ms per token) |
|---|---|---|---|---|---|---|---|---|---|---|---|
{parts}
""")
    return "\n".join(out)


def main(a, argv: list[str]):
    result = run_parts(a)
    report.publish("engine", section(a, result, argv), not a.no_write)
