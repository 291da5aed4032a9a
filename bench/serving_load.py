"""Online serving benchmark, in the manner of vLLM's benchmark_serving: streamed requests
against a running server, timed from the arrival of each streamed chunk.

Against any running server (native JSON API, `stream: true`):

    python bench/serving_load.py --url http://127.0.0.1:8080 --key-file key_file.json \\
        --num-requests 64 --concurrency 8 [--request-rate 4] [--idle-requests 16]

Side by side, on private TorchServes that it starts and stops itself (tools/local_server.py):
continuous batching (batchSize 8) against one request at a time (batchSize 1), same random
~21M-parameter Llama, same TP, same requests; writes its table into BENCHMARKS.md:

    python bench/serving_load.py --compare

Metrics, as vLLM defines them:
  TTFT  time to first token: from sending the request to the first streamed chunk.
  TPOT  time per output token after the first: (latency - TTFT) / (output tokens - 1), per request.
  ITL   inter-token latency: the gaps between consecutive chunks of a stream, all requests pooled
        (a chunk that carries two tokens counts once, with a gap twice as long).
  output tokens/s: completion tokens (the server's usage) of all requests / benchmark duration.
Idle TTFT: the first --idle-requests requests sent one after another to a server with nothing
else to do. Busy TTFT: the same requests sent at random moments while --concurrency - 1 clients
keep the server decoding, counted when another request was decoding as they were sent (it had
its first token and not yet its last); also for the load run's own requests.
"""

import argparse
import datetime
import itertools
import json
import math
import os
import random
import re
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import psutil
import requests

import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]
TOKENIZER = os.path.join(ROOT, "demo", "tokenizer.model")

# Ordinary English text that prompts are cut from (written for this benchmark).
PROSE = """\
The market opens early on Saturdays, before the sun has cleared the roofs of the old town. Farmers
back their vans into the square and unfold tables covered with crates of apples, potatoes and bunches
of carrots that still carry a little of the field on them. By eight o'clock the baker has sold half of
his bread, and the queue at the cheese stall reaches the fountain. Children run between the stalls
with paper bags of cherries while their parents argue gently about what to cook for dinner. An old
man plays the accordion near the church steps, always the same three songs, and nobody seems to mind.
When it rains, the traders pull plastic sheets over their goods and carry on as if nothing had
happened. The fishmonger tells anyone who will listen that the weather was better when he was young.
Around noon the crowd thins out, prices drop, and the last customers fill their baskets with whatever
is left. In the afternoon the square is swept, the tables are folded away, and the pigeons return to
look for crumbs. Most people in the town say that the market is the reason they stayed, or the reason
they came back after years in the city. It is not that the vegetables are cheaper or the bread is
better than elsewhere. It is that on Saturday morning everyone meets everyone, news travels from one
stall to the next, and for a few hours the town feels like a single household. A young couple who
moved here last spring now run a small stand selling honey and candles. They admit that they knew
nothing about bees when they started, and that the first summer was a disaster. The neighbours helped,
lent them tools and advice, and this year their honey sells out before ten. The mayor likes to point
at them when journalists ask whether small towns have a future."""


# --- requests ------------------------------------------------------------------------------

def make_prompts(n: int, lo: int, hi: int, tokenizer_path: str, seed: int) -> list[str]:
    """n prompts cut from PROSE from a random word on, each the longest run of words within a
    random target of lo..hi tokens (counted as the server counts them, with BOS)."""
    from tokenizer import Tokenizer

    tokenizer = Tokenizer(tokenizer_path)
    words = PROSE.split()
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        target, start = rng.randint(lo, hi), rng.randrange(len(words))
        text = words[start]
        for i in range(1, len(words)):
            longer = text + " " + words[(start + i) % len(words)]
            if len(tokenizer.encode(longer, bos=True, eos=False)) > target:
                break
            text = longer
        prompts.append(text)
    return prompts


def request_bodies(prompts: list[str], max_new_tokens: int, temperature: float) -> list[dict]:
    # a seed per request: both servers of --compare generate the same tokens
    return [{"prompt": p, "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": i,
             "stream": True} for i, p in enumerate(prompts)]


@dataclass
class Result:
    start: float = 0.0  # perf_counter when the request was sent
    ttft: float = 0.0
    latency: float = 0.0  # to the last chunk
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def decoding(self) -> tuple[float, float]:
        """The span during which it had its first token and not yet its last."""
        return self.start + self.ttft, self.start + self.latency


class Target:
    """A server's predictions URL and key; one HTTP session per client thread (keep-alive)."""

    def __init__(self, url: str, key: str | None, model: str = "llama"):
        self.url = f"{url.rstrip('/')}/predictions/{model}"
        self.headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
        self.local = threading.local()

    def session(self) -> requests.Session:
        if not hasattr(self.local, "session"):
            self.local.session = requests.Session()
        return self.local.session

    def send(self, body: dict) -> Result:
        """One streamed request, timed at the arrival of each chunk."""
        out = Result(start=time.perf_counter())
        data = b""
        try:
            with self.session().post(self.url, data=json.dumps(body), headers=self.headers, stream=True,
                                     timeout=600) as r:
                if r.status_code != 200:
                    out.error = f"HTTP {r.status_code}: {r.text[:200]}"
                    return out
                last = None
                # chunk_size=None: one item per HTTP chunk, i.e. per message of the handler
                for chunk in r.iter_content(chunk_size=None):
                    now = time.perf_counter()
                    if last is None:
                        out.ttft = now - out.start
                    else:
                        out.itl.append(now - last)
                    last, data = now, data + chunk
                out.latency = last - out.start if last else 0.0
            lines = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
        except (requests.RequestException, ValueError) as e:
            out.error = f"{type(e).__name__}: {e}"
            return out
        final = lines[-1] if lines else {}
        if "usage" not in final:  # an error line, or a stream cut short
            out.error = f"no usage in the last line: {json.dumps(final)[:200]}"
            return out
        out.prompt_tokens, out.output_tokens = final["usage"]["prompt_tokens"], final["usage"]["completion_tokens"]
        return out


def run_load(target: Target, bodies: list[dict], concurrency: int, rate: float, ramp_up: float,
             seed: int) -> tuple[list[Result], float]:
    """Send bodies with at most `concurrency` in flight (0: no limit). rate: Poisson arrivals
    per second (inf: each as soon as a client is free, a closed loop). ramp_up: the first
    `concurrency` requests are spread over this many seconds, so that the clients do not
    start, decode and finish in lockstep. Returns the results and the duration."""
    rng = np.random.default_rng(seed)
    slots = threading.Semaphore(concurrency or len(bodies))
    results: list[Result | None] = [None] * len(bodies)

    def one(i: int):
        try:
            results[i] = target.send(bodies[i])
        finally:
            slots.release()

    begin = time.perf_counter()
    due = begin
    with ThreadPoolExecutor(concurrency or len(bodies)) as pool:
        for i in range(len(bodies)):
            if math.isfinite(rate):
                due += rng.exponential(1 / rate)
            elif concurrency and i < concurrency:
                due = begin + ramp_up * i / concurrency
            time.sleep(max(0.0, due - time.perf_counter()))
            slots.acquire()
            pool.submit(one, i)
    return results, time.perf_counter() - begin


def run_one_by_one(target: Target, bodies: list[dict]) -> list[Result]:
    return [target.send(b) for b in bodies]


def run_probes(target: Target, background: list[dict], probes: list[dict], clients: int, ramp_up: float,
               seed: int) -> tuple[list[Result], list[Result]]:
    """Requests that arrive at moments of their own while others decode: `clients` closed-loop
    clients cycle through `background`; once they all run, the probes go one after another,
    each after a random pause (0-0.5 s, longer than an iteration: its arrival falls anywhere
    in one). Returns the probes' results and the background's."""
    rng = random.Random(seed)
    stop = threading.Event()
    done: list[Result] = []

    def client(k: int):
        time.sleep(ramp_up * k / clients)
        for i in itertools.count(k, clients):
            if stop.is_set():
                return
            done.append(target.send(background[i % len(background)]))

    with ThreadPoolExecutor(clients) as pool:
        for k in range(clients):
            pool.submit(client, k)
        time.sleep(ramp_up)
        results = []
        for body in probes:
            time.sleep(rng.uniform(0, 0.5))
            results.append(target.send(body))
        stop.set()
    return results, done


# --- metrics -------------------------------------------------------------------------------

def stats(values: list[float]) -> dict:
    """mean, median and p99 in ms (numpy's linear percentiles, as vLLM)."""
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    a = np.asarray(values) * 1000
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.error is None]
    output = sum(r.output_tokens for r in ok)
    return {"requests": len(results), "completed": len(ok), "duration": duration,
            "prompt_tokens": [r.prompt_tokens for r in ok], "output_tokens": [r.output_tokens for r in ok],
            "request_throughput": len(ok) / duration, "output_throughput": output / duration,
            "ttft": stats([r.ttft for r in ok]),
            "tpot": stats([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
            "itl": stats([gap for r in ok for gap in r.itl]),
            "latency": stats([r.latency for r in ok]),
            "errors": sorted({r.error for r in results if r.error})[:5]}


def print_summary(title: str, m: dict):
    print(f"{f' {title} ':=^60}")
    print(f"{'Successful requests:':<40} {m['completed']} of {m['requests']}")
    print(f"{'Benchmark duration (s):':<40} {m['duration']:.2f}")
    print(f"{'Total input tokens:':<40} {sum(m['prompt_tokens'])}")
    print(f"{'Total generated tokens:':<40} {sum(m['output_tokens'])}")
    print(f"{'Request throughput (req/s):':<40} {m['request_throughput']:.2f}")
    print(f"{'Output token throughput (tok/s):':<40} {m['output_throughput']:.1f}")
    for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("latency", "E2E latency")):
        for stat in ("mean", "median", "p99"):
            print(f"{f'{stat.capitalize()} {name} (ms):':<40} {m[key][stat]:.1f}")
    for e in m["errors"]:
        print(f"error: {e}")


# --- the server's side (private servers only) ---------------------------------------------

def cpu_seconds(server) -> dict:
    """CPU seconds so far of the server's frontend, its ranks, its other processes (torchrun),
    this benchmark, and the whole machine."""
    out = {"frontend": 0.0, "ranks": 0.0, "torchrun": 0.0}
    java = server.frontend()
    ranks = server.worker_pids()
    for p in [java] + java.children(recursive=True):
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        kind = "frontend" if p is java else "ranks" if p.pid in ranks else "torchrun"
        out[kind] += t.user + t.system
    me = psutil.Process().cpu_times()
    out["client"] = me.user + me.system
    total = psutil.cpu_times()
    out["machine"] = total.user + total.nice + total.system + total.irq + total.softirq + total.steal
    return out


LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d{3}) ")


def iterations(server, begin: float, end: float) -> dict:
    """Per-iteration figures of the frontend's log (ts_log.log) between two time.time()s:
    how many iterations, and the mean backend response time (the frontend's wait for rank 0's
    reply) and handler time (BaseHandler.handle, both ranks) in ms. TorchServe writes each
    line twice; set() keeps one."""
    loops, backend, handler, engine, steps = 0, [], [], [], []
    for line in set(server.log("ts_log.log").splitlines()):
        m = LOG_TIME.match(line)
        if not m:
            continue
        t = datetime.datetime.strptime(m[1], "%Y-%m-%dT%H:%M:%S,%f").timestamp()
        if not begin <= t <= end:
            continue
        if "Looping backend response at:" in line:
            loops += 1
        elif m2 := re.search(r"Backend response time: (\d+)", line):
            backend.append(float(m2[1]))
        elif m2 := re.search(r"\[METRICS\]HandlerTime\.Milliseconds:([\d.]+)", line):
            handler.append(float(m2[1]))
        elif m2 := re.search(r"\[METRICS\]EngineTime\.\w+:([\d.]+)", line):
            engine.append(float(m2[1]))
        elif m2 := re.search(r"\[METRICS\]EngineSteps\.\w+:([\d.]+)", line):
            steps.append(float(m2[1]))

    def mean(values):
        return float(np.mean(values)) if values else float("nan")

    return {"iterations": loops, "backend_ms": mean(backend), "handler_ms": mean(handler), "engine_ms": mean(engine),
            "steps": mean(steps)}


# --- one server: idle requests, then the load -----------------------------------------------

def measure(target: Target, bodies: list[dict], a, server=None, probes: bool = True) -> dict:
    """Warm up; send the first --idle-requests bodies one after another (idle TTFT); all bodies
    as the load; then the same first ones again at random moments while --concurrency - 1
    clients keep the server decoding (busy TTFT; unless probes is False). With a private
    server, also its per-iteration figures and CPU use."""
    run_one_by_one(target, [b | {"max_new_tokens": 4} for b in bodies[:2]])  # first-call costs out of the way
    out = {}
    firsts = bodies[:a.idle_requests]
    if firsts:
        out["idle"] = phase(server, lambda: timed(run_one_by_one, target, firsts))
    spread = ramp_up(a, out)
    out["load"] = phase(server, lambda: run_load(target, bodies, a.concurrency, a.request_rate, spread, a.seed))
    out["load"]["ramp_up"] = spread
    if firsts and probes and a.concurrency > 1:
        out["load"]["busy_ttft"] = busy_ttft(out["load"]["results"], out["load"]["results"])
        found, background = run_probes(target, bodies, firsts, a.concurrency - 1, spread, a.seed)
        out["probe_ttft"] = busy_ttft(found, background)
    return out


def busy_ttft(results: list[Result], others: list[Result]) -> dict:
    """TTFT of the results sent while at least one of others was decoding (had its first
    token and not yet its last)."""
    busy = [r for r in results if r.error is None
            and any(o is not r and o.error is None and o.decoding[0] <= r.start < o.decoding[1] for o in others)]
    return stats([r.ttft for r in busy]) | {"n": len(busy), "of": len(results)}


def phase(server, run) -> dict:
    wall0, cpu0 = time.time(), cpu_seconds(server) if server else None
    results, duration = run()
    m = summarize(results, duration) | {"results": results}
    if server:
        cpu1 = cpu_seconds(server)
        m["cpu"] = {k: (cpu1[k] - cpu0[k]) / duration for k in cpu1}  # cores busy, on average
        m["server"] = iterations(server, wall0, time.time())
    return m


def ramp_up(a, out: dict) -> float:
    """--ramp-up, or by default one idle request's latency (median): the clients' first
    requests then end at different iterations, and so do all the ones after."""
    if a.ramp_up is not None:
        return a.ramp_up
    return out["idle"]["latency"]["median"] / 1000 if "idle" in out else 0.0


def timed(fn, *args):
    begin = time.perf_counter()
    results = fn(*args)
    return results, time.perf_counter() - begin


def print_measurement(label: str, m: dict):
    if "idle" in m:
        print_summary(f"{label}: idle, one request at a time", m["idle"])
    print_summary(f"{label}: load", m["load"])
    idle = m["idle"]["ttft"]["median"] if "idle" in m else None
    for name, busy in (("closed-loop arrivals of the load", m["load"].get("busy_ttft")),
                       ("random arrivals", m.get("probe_ttft"))):
        if busy and idle:
            print(f"Busy TTFT median, {name}: {busy['median']:.1f} ms ({busy['n']} of {busy['of']} requests "
                  f"arrived while others decoded) / idle TTFT median {idle:.1f} ms = {busy['median'] / idle:.2f}")


# --- --compare: private servers, side by side ---------------------------------------------

def write_checkpoint(out: str, dim: int, layers: int, heads: int) -> tuple[str, dict]:
    """A random Llama in Meta layout with the demo tokenizer: its folder, and its params.json
    and size."""
    import make_checkpoint
    from tokenizer import Tokenizer

    model = make_checkpoint.random_hf_model(dim, layers, heads, heads, Tokenizer(TOKENIZER).n_words)
    folder = make_checkpoint.write_layouts(model, out, TOKENIZER, ["meta:1"])["meta:1"]
    return folder, model.meta_params | {"parameters": sum(p.numel() for p in model.parameters()),
                                        "ffn_dim": model.config.intermediate_size}


def compare(a, bodies: list[dict]) -> dict:
    from local_server import start_server

    runs, built_from = {}, revision()
    with tempfile.TemporaryDirectory(prefix="bench_serving_") as tmp:
        ckpt, model = write_checkpoint(tmp, a.dim, a.layers, a.heads)
        print(f"random Llama: {model['parameters']:,} parameters, dim {a.dim}, {a.layers} layers, {a.heads} heads")
        for slots in a.batch_sizes:
            workdir = os.path.join(tmp, f"batch{slots}")
            os.makedirs(workdir)
            server = start_server(workdir, ckpt, tp=a.tp, batch_size=slots, model_config=server_config(a))
            try:
                runs[slots] = measure(Target(server.url, server.key), bodies, a, server, probes=slots > 1)
                runs[slots]["config"] = server.config
            finally:
                server.stop()
            print_measurement(f"batchSize {slots}", runs[slots])
    return {"model": model, "runs": runs, "revision": built_from}


def server_config(a) -> dict:
    """model-config.yaml settings that --compare changes (the rest is the repository's)."""
    return {"maxBatchDelay": a.max_batch_delay} if a.max_batch_delay is not None else {}


# --- BENCHMARKS.md ---------------------------------------------------------------------------

def ms3(s: dict) -> str:
    return f"{s['mean']:.0f} / {s['median']:.0f} / {s['p99']:.0f}"


def results_table(runs: dict, clients: int) -> str:
    lines = ["| server | clients | requests | output tokens per request (min–max) | duration (s) | requests/s | "
             "**output tokens/s** | TTFT mean / median / p99 (ms) | TPOT mean / median / p99 (ms) | "
             "ITL mean / median / p99 (ms) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for phase_name in ("load", "idle"):
        for slots, m in runs.items():
            r = m[phase_name]
            out = r["output_tokens"]
            who = f"batchSize {slots}" + (", idle" if phase_name == "idle" else "")
            lines.append(f"| {who} | {clients if phase_name == 'load' else 1} | {r['completed']} of {r['requests']} | "
                         f"{np.mean(out):.1f} ({min(out)}–{max(out)}) | {r['duration']:.1f} | "
                         f"{r['request_throughput']:.2f} | **{r['output_throughput']:.1f}** | {ms3(r['ttft'])} | "
                         f"{ms3(r['tpot'])} | {ms3(r['itl'])} |")
    return "\n".join(lines)


def per_iteration(r: dict) -> tuple[float, float, float, float]:
    """tokens, wall ms, rank 0's reply ms and handle() ms per iteration of a run"""
    n = max(r["server"]["iterations"], 1)
    return sum(r["output_tokens"]) / n, r["duration"] * 1000 / n, r["server"]["backend_ms"], r["server"]["handler_ms"]


def rest_cores(cpu: dict) -> float:
    """CPU cores the rest of the machine used, besides the ranks, frontend, torchrun and client"""
    return max(cpu["machine"] - cpu["ranks"] - cpu["frontend"] - cpu["torchrun"] - cpu["client"], 0)


def server_table(runs: dict, clients: int) -> str:
    lines = ["| run | iterations | tokens per iteration | wall time per iteration (ms) | rank 0's reply, "
             "as the frontend waits for it (ms) | handle() (ms) | CPU cores busy: ranks / frontend (Java) / "
             "torchrun / this client / rest of the machine |", "|---|---|---|---|---|---|---|"]
    for slots, m in runs.items():
        for phase_name in ("load", "idle"):
            r = m[phase_name]
            cpu = r["cpu"]
            tokens, wall, backend, handler = per_iteration(r)
            lines.append(f"| batchSize {slots}, {f'{clients} clients' if phase_name == 'load' else 'idle'} | "
                         f"{r['server']['iterations']} | {tokens:.2f} | {wall:.1f} | {backend:.1f} | {handler:.1f} | "
                         f"{cpu['ranks']:.2f} / {cpu['frontend']:.2f} / {cpu['torchrun']:.2f} / {cpu['client']:.2f} / "
                         f"{rest_cores(cpu):.2f} |")
    return "\n".join(lines)


def revision() -> str:
    """The commit the servers were built from, and the served files (the repository's *.py, which go into
    the archive) that differed from it."""
    import subprocess

    def git(*args) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    changed = [f for f in git("diff", "--name-only", "HEAD").split() if "/" not in f and f.endswith(".py")]
    head = git("rev-parse", "--short", "HEAD")
    return head + (f" with uncommitted changes to {', '.join(changed)}" if changed else "")


def section(a, result: dict, argv: list[str]) -> str:
    import ts

    model, runs = result["model"], result["runs"]
    many, one = runs[max(runs)], runs[min(runs)]
    speedup = many["load"]["output_throughput"] / one["load"]["output_throughput"]
    idle = many["idle"]["ttft"]["median"]
    probe, loop = many["probe_ttft"], many["load"]["busy_ttft"]
    prompt = many["load"]["prompt_tokens"]
    config = many["config"]
    torchrun = config["torchrun"]
    spread = " (one idle request's latency)" if a.ramp_up is None else ""
    return f"""## Serving: continuous batching against one request at a time

`{' '.join(['python', 'bench/serving_load.py'] + argv)}` — {report.header()},
TorchServe {ts.__version__}; commit {result['revision']}.

- Model: random Llama (tools/make_checkpoint.py), **{model['parameters']:,} parameters**: dim {model['dim']}, \
{model['n_layers']} layers, {model['n_heads']} heads ({model['n_kv_heads']} KV heads), FFN {model['ffn_dim']}, \
vocabulary {model['vocab_size']} (demo/tokenizer.model); Meta layout, float32.
- Servers: TorchServe with handler.py and the repository's model-config.yaml, changed only in batchSize \
({' against '.join(str(s) for s in runs)}): TP={torchrun['nproc-per-node']} on CPU (torchrun, gloo, \
OMP_NUMBER_THREADS={torchrun['OMP_NUMBER_THREADS']} per rank), continuousBatching, maxBatchDelay \
{config['maxBatchDelay']} ms, max_seq_len {config['handler']['max_seq_len']}. One server at a time, on the same \
machine as the client.
- Requests: {len(prompt)} prompts of ordinary English text, {min(prompt)}–{max(prompt)} tokens \
(mean {np.mean(prompt):.0f}), max_new_tokens {a.max_new_tokens}, temperature {a.temperature} (top_p 0.9, a seed \
per request: both servers generate the same tokens), streamed (native API, `stream: true`). Load: \
{a.concurrency} clients in a closed loop (each sends its next request when its last one ends), their first \
requests spread over {many['load']['ramp_up']:.1f} s{spread} so that they do not start and end together; idle: \
the first {a.idle_requests} of the same requests one after another.
- Metrics as vLLM's benchmark_serving defines them (see the script's docstring); duration from the first \
request sent to the last answer.

{results_table(runs, a.concurrency)}

- **Output tokens/s with {a.concurrency} clients: {speedup:.2f}× the one-at-a-time server** (target ≥ 4×: \
{'met' if speedup >= 4 else 'missed'}).
- **Busy / idle TTFT: {probe['median'] / idle:.2f}** (target ≤ 2: \
{'met' if probe['median'] <= 2 * idle else 'missed'}): median TTFT {probe['median']:.0f} ms of {probe['n']} \
requests (the idle run's) sent at random moments while {a.concurrency - 1} closed-loop clients kept the \
batchSize {max(runs)} server decoding, against {idle:.0f} ms for the same requests on the idle server. The \
requests of the load run itself, which arrive just as another ends, had a median TTFT of {loop['median']:.0f} ms \
({loop['n']} of them arrived while others decoded): {loop['median'] / idle:.2f}× idle.

The servers' side, from TorchServe's log (ts_log.log: one "Looping backend response" line per iteration, \
"Backend response time", the handler's HandlerTime) and the processes' CPU time (psutil):

{server_table(runs, a.concurrency)}

{notes(model, runs, torchrun['nproc-per-node'])}
"""


def notes(model: dict, runs: dict, tp: int) -> str:
    """What the figures say, with the figures."""
    many, one = runs[max(runs)], runs[min(runs)]
    t8, w8, b8, h8 = per_iteration(many["load"])
    _, w1, b1, h1 = per_iteration(one["load"])
    cpu = many["load"]["cpu"]
    collectives = 2 * model["n_layers"] + 2
    probe, idle = many["probe_ttft"]["median"], many["idle"]["ttft"]["median"]
    return f"""Reading the figures:
- Speed-up = tokens per iteration × ratio of iteration times: one at a time, 1 token per {w1:.1f} ms iteration; \
batchSize {max(runs)}, {t8:.2f} tokens (slots are idle during the ramp-up and the last requests) per {w8:.1f} ms \
iteration, {w8 / w1:.2f}× as long: {t8:.2f} × {w1:.1f} / {w8:.1f} = {t8 * w1 / w8:.2f}×. handle() takes \
{h8:.1f} ms for {max(runs)} sequences (and the prefills of the requests admitted) against {h1:.1f} ms for one: \
each step reads each rank's weights (about {model['parameters'] * 4 / tp / 1e6:.0f} MB) once and makes the same \
{collectives} collectives ({model['n_layers']} layers × 2 all-reduces, the logits' all-gather, the sampled \
tokens' broadcast) whatever the batch; what grows with it is the arithmetic, attention over each sequence's \
cache, and the per-sequence Python work (sampling, detokenizing, the streamed chunks).
- TorchServe's share of an iteration, outside handle(): {w1 - b1:.1f} ms in the frontend (wall time − rank 0's \
reply) + {b1 - h1:.1f} ms in the worker (sockets, protocol, metrics lines) at batchSize 1, \
{(w1 - h1) / w1:.0%} of its iteration; {w8 - b8:.1f} + {b8 - h8:.1f} ms at batchSize {max(runs)}, shared by \
{t8:.1f} tokens.
- On 2 cores the {tp} ranks (one thread each) need both cores: during the batchSize {max(runs)} load they used \
{cpu['ranks']:.2f} cores, the frontend (Java) {cpu['frontend']:.2f}, this client {cpu['client']:.2f}, the rest \
of the machine {rest_cores(cpu):.2f}. Whatever else runs takes a core from one rank, and the other rank waits for it \
at the next collective.
- TTFT: a request that arrives while others decode waits for the iteration in progress, then for the whole next \
one, which decodes the running sequences and prefills it; its first token goes out with their tokens at the end \
of that iteration. That is about 1.5 iterations plus its prefill, against its prefill (plus maxBatchDelay, the \
frontend's wait for company when nothing is in flight) on the idle server: {probe:.0f} against {idle:.0f} ms. \
The load run's own requests arrive just after an iteration began (their predecessor's last chunk ended the \
previous one), so they wait about half an iteration longer."""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8080")
    where.add_argument("--compare", action="store_true", help="start private servers, batchSize 8 against 1")
    where.add_argument("--engine", action="store_true", help="the serving engine's workloads (bench/engine_workloads.py)")
    ap.add_argument("--baseline", default="f51d891", help="--engine: the commit to compare with")
    ap.add_argument("--parts", nargs="+", default=["today", "shared", "memory", "long", "sweep", "single"],
                    help="--engine: which workloads")
    ap.add_argument("--long-budget", type=int, default=None, help="--engine: max_batched_tokens for the long prompt")
    ap.add_argument("--key", help="the inference key")
    ap.add_argument("--key-file", help="TorchServe's key_file.json")
    ap.add_argument("--model", default="llama")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight at most (0: no limit)")
    ap.add_argument("--request-rate", type=float, default=float("inf"),
                    help="Poisson arrivals per second (default inf: a closed loop of --concurrency clients)")
    ap.add_argument("--ramp-up", type=float, default=None,
                    help="s over which the first --concurrency requests are spread (default: one idle "
                         "request's latency when idle requests are measured, else 0)")
    ap.add_argument("--idle-requests", type=int, default=None,
                    help="requests sent one by one first, for the idle TTFT (default: 16 with --compare, else 0)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--tokenizer", default=TOKENIZER, help="sizes the prompts (the server counts its own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dim", type=int, default=512, help="--compare's random model")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 1])
    ap.add_argument("--max-batch-delay", type=int, default=None, help="ms; default: model-config.yaml's")
    ap.add_argument("--no-write", action="store_true", help="--compare: leave BENCHMARKS.md alone")
    a = ap.parse_args()
    if a.idle_requests is None:
        a.idle_requests = 16 if a.compare else 0

    if a.engine:
        import engine_workloads

        if a.idle_requests is None or a.idle_requests == 0:
            a.idle_requests = 16
        engine_workloads.main(a, sys.argv[1:])
        return
    prompts = make_prompts(a.num_requests, *a.prompt_tokens, a.tokenizer, a.seed)
    bodies = request_bodies(prompts, a.max_new_tokens, a.temperature)
    if a.compare:
        result = compare(a, bodies)
        text = section(a, result, sys.argv[1:])
        report.publish("serving", text, not a.no_write)
        return
    from wait_ready import inference_key

    key = a.key or (inference_key(a.key_file) if a.key_file else None)
    print_measurement(a.url, measure(Target(a.url, key, a.model), bodies, a))


if __name__ == "__main__":
    main()
