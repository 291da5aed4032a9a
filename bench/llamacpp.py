"""This project against llama.cpp on the same GGUF file, on this CPU, in one run:

    make llamacpp smollm2
    python bench/llamacpp.py [--threads 2] [--formats Q4_1 Q8_0 F32] [--parts decode prefill perplexity serving]
                             [--no-write]

The file is SmolLM2-135M-Instruct's Q4_1 GGUF (make smollm2); its Q8_0 and F32 forms are made
from it by llama.cpp's llama-quantize (--allow-requantize), so every format holds the same
model. Ours serves Q4_1 with QUANT=int4, Q8_0 with QUANT=int8 (both keep the file's blocks)
and F32 unquantized. Measured, one after the other, nothing else running:

- decode: tokens/s of 128 tokens at batch 1 (llama-bench tg128; ours: the engine's steps after
  the first token, greedy, EOS ignored, eager and with the decode step compiled), at 1 and 2 threads;
- prefill: tokens/s of a 512-token prompt (llama-bench pp512; ours: one forward pass);
- perplexity: llama-perplexity's method (chunks of --ctx tokens, the second half of each scored)
  on the same text, by llama-perplexity and by ours;
- serving: llama-server (-np 8) against TorchServe with our handler (TP=1), both on loopback,
  the same /v1/completions requests (16 prompts, 128 new tokens, EOS ignored), greedy and
  sampled: one stream, then 8 clients at once; output tokens/s;
- transformers: its own GGUF loader's model (fp32) decoding the Q4_1 file's 128 tokens at
  batch 1 (generate, greedy, EOS ignored) against ours from the same file, unquantized,
  QUANT=int8 and QUANT=int4.

Writes BENCHMARKS.md's llamacpp section (ratios ours / llama.cpp, and each side's command).
"""

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools"), os.path.dirname(os.path.abspath(__file__))]
import report  # noqa: E402

BIN = os.path.join(ROOT, ".llamacpp", "build", "bin")
SMOLLM2 = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
TEXT = os.path.join(ROOT, "tests", "data", "devils_dictionary.txt")
QUANT = {"Q4_1": "int4", "Q8_0": "int8", "F32": None}  # ours for each file format
NEW_TOKENS = 128
PROMPTS = [f"Write a short story about {thing}." for thing in (
    "a lighthouse keeper", "a lost umbrella", "the first snow", "a talking cat", "an old map", "a broken clock",
    "a city at night", "a quiet library", "a train journey", "a garden in spring", "a stubborn robot",
    "a village baker", "a message in a bottle", "a mountain storm", "a forgotten song", "a chess champion")]


# --- the files --------------------------------------------------------------------------------

def formats(names: list[str], folder: str) -> dict[str, str]:
    """{format: GGUF file}: SmolLM2's Q4_1 file, and the others made from it by llama-quantize."""
    files = {"Q4_1": SMOLLM2}
    for name in names:
        if name not in files:
            files[name] = os.path.join(folder, f"SmolLM2-135M-Instruct.{name}.gguf")
            run([os.path.join(BIN, "llama-quantize"), "--allow-requantize", SMOLLM2, files[name], name])
    return {name: files[name] for name in names}


def run(cmd: list[str], env: dict | None = None, stderr: bool = False) -> str:
    """What cmd prints (with its stderr, where llama.cpp's tools report)."""
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return done.stdout + (done.stderr if stderr else "")


# --- llama.cpp ------------------------------------------------------------------------------

def llama_bench(path: str, threads: int, prompt: int, new: int) -> float:
    """llama-bench's tokens/s (mean of 3 repetitions) of a prompt (pp) or a generation (tg)."""
    out = run([os.path.join(BIN, "llama-bench"), "-m", path, "-t", str(threads), "-p", str(prompt), "-n", str(new),
               "-r", "3", "-o", "json"])
    return json.loads(out[out.index("["):out.rindex("]") + 1])[0]["avg_ts"]


def llama_perplexity(path: str, threads: int, ctx: int) -> float:
    out = run([os.path.join(BIN, "llama-perplexity"), "-m", path, "-f", TEXT, "-c", str(ctx), "-b", str(ctx),
               "-t", str(threads)], stderr=True)
    return float(re.search(r"Final estimate: PPL = ([0-9.]+)", out)[1])


@contextlib.contextmanager
def llama_server(path: str, threads: int):
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")
    proc = subprocess.Popen([os.path.join(BIN, "llama-server"), "-m", path, "-t", str(threads), "-np", "8",
                             "-c", str(8 * 512), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: requests.get(f"{url}/health", timeout=2).status_code == 200, proc, log)
        yield url + "/v1/completions", {}
    finally:
        proc.terminate()
        proc.wait(30)


def free_port() -> int:
    from local_server import free_port as pick

    return pick()


def wait_until(ready, proc, log, timeout: float = 300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server exited:\n{log.read()[-3000:]}")
        with contextlib.suppress(requests.RequestException):
            if ready():
                return
        time.sleep(0.5)
    raise TimeoutError("the server did not come up")


# --- ours -----------------------------------------------------------------------------------

def ours(part: str, path: str, quant: str | None, threads: int, *args) -> dict:
    """One of our in-process measurements (measure()), in a process of its own with `threads` threads."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=ROOT)
    out = run([sys.executable, os.path.abspath(__file__), "--measure", part, path, str(quant), str(threads),
               *map(str, args)], env=env)
    return json.loads(out.strip().splitlines()[-1])


def measure(part: str, path: str, quant: str, threads: int, *args):
    """Prints one measurement as JSON (run by ours())."""
    import torch

    torch.set_num_threads(threads)
    from llama2 import tp_llama

    ctx = int(args[0]) if part == "perplexity" else 512
    llama = tp_llama(None, path, path, 1, max_batch_size=1, max_seq_len=max(ctx, 640),
                     quantization=None if quant == "None" else quant)
    if part == "decode" and args and args[0] == "compiled":
        llama.runner.compile_decode(cpp_wrapper=True)  # as the server compiles it
    print(json.dumps({"decode": decode_rate, "prefill": prefill_rate, "perplexity": perplexity}[part](llama, ctx)))


def transformers_rate(path: str, threads: int) -> float:
    """transformers' decode tokens/s of NEW_TOKENS greedy tokens (its GGUF loader, fp32), in a
    process of its own (the best of 3 generations after a warm-up)."""
    code = f"""
import json, os, time, torch
torch.set_num_threads({threads})
from transformers import AutoTokenizer, LlamaForCausalLM
folder, name = os.path.split({path!r})
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = LlamaForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
ids = tok("Once upon a time", return_tensors="pt").input_ids
kw = dict(max_new_tokens={NEW_TOKENS}, min_new_tokens={NEW_TOKENS}, do_sample=False)
model.generate(ids, max_new_tokens=8, do_sample=False)
times = []
for _ in range(3):
    start = time.perf_counter()
    model.generate(ids, **kw)
    times.append(time.perf_counter() - start)
print(json.dumps({NEW_TOKENS} / min(times)))
"""
    out = run([sys.executable, "-c", code], env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    return json.loads(out.strip().splitlines()[-1])


def decode_rate(llama, _) -> float:
    """Tokens/s of NEW_TOKENS greedy tokens at batch 1, after the first (the prompt's step)."""
    from engine import Engine
    from sequence import SamplingParams

    engine = Engine(llama.runner, llama.tokenizer)
    rates = []
    for _ in range(3):
        seq = engine.add(llama.tokenizer.encode("Once upon a time", bos=True, eos=False),
                         SamplingParams(max_gen_len=NEW_TOKENS + 1, temperature=0, ignore_eos=True))
        engine.step()
        start = time.perf_counter()
        while engine.running:
            engine.step()
        rates.append((len(seq.tokens) - 1) / (time.perf_counter() - start))
        engine.release(seq)
    return statistics.median(rates)


def prefill_rate(llama, _, n: int = 512) -> float:
    """Tokens/s of one forward pass over n tokens (the best of 3)."""
    import torch

    tokens = torch.randint(0, llama.tokenizer.n_words, (1, n), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        llama.runner(tokens, 0)
        times.append(time.perf_counter() - start)
    return n / min(times)


def perplexity(llama, ctx: int) -> float:
    """llama-perplexity's method: the text's tokens (a BOS where the tokenizer adds one) in
    chunks of ctx, each evaluated on its own (its first token BOS where the tokenizer adds
    one); the tokens of the second half of each chunk scored."""
    import torch

    tok = llama.tokenizer
    tokens = tok.encode(open(TEXT).read(), bos=True, eos=False)
    first, nll, count = ctx // 2, 0.0, 0
    for start in range(0, len(tokens) - ctx + 1, ctx):
        chunk = tokens[start:start + ctx]
        if tok.add_bos:
            chunk[0] = tok.bos_id
        logits = llama.runner(torch.tensor([chunk]), 0)[0, first:ctx - 1].double()
        nll -= torch.log_softmax(logits, -1).gather(-1, torch.tensor(chunk[first + 1:])[:, None]).sum().item()
        count += ctx - 1 - first
    return float(torch.exp(torch.tensor(nll / count)))


@contextlib.contextmanager
def our_server(path: str, quant: str | None, threads: int, compiled: bool):
    """TorchServe with our handler serving path at TP=1; compiled: handler.compile, its
    graphs in this user's inductor cache (as make serve's are across restarts)."""
    from local_server import start_server
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    with tempfile.TemporaryDirectory() as tmp:
        handler = {"max_seq_len": 512, "compile": compiled} | ({"quantization": quant} if quant else {})
        server = start_server(tmp, None, tp=1, batch_size=8, threads=threads, env={"TORCHINDUCTOR_CACHE_DIR": cache_dir()},
                              timeout=1200,  # a first compile takes minutes
                              handler=handler | {"checkpoint": path, "tokenizer": path})
        try:
            yield server.url + "/predictions/llama/1.0/v1/completions", {"Authorization": f"Bearer {server.key}"}
        finally:
            server.stop()


# --- serving --------------------------------------------------------------------------------

def clients(url: str, headers: dict, concurrency: int, temperature: float) -> float:
    """Output tokens/s of PROMPTS sent by `concurrency` clients at once (each request whole,
    NEW_TOKENS tokens, EOS ignored), after one warm-up request."""
    def send(i: int) -> int:
        body = {"model": "llama", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": NEW_TOKENS,
                "temperature": temperature, "seed": i, "ignore_eos": True}
        r = requests.post(url, json=body, headers=headers, timeout=600)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    send(0)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(send, range(len(PROMPTS))))
    return tokens / (time.perf_counter() - start)


def serving(path: str, quant: str | None, threads: int, compiled: bool) -> dict:
    out = {}
    for side, server in (("llama.cpp", llama_server(path, threads)), ("ours", our_server(path, quant, threads, compiled))):
        with server as (url, headers):
            for temperature in (0.0, 0.7):
                for n in (1, 8):
                    out[side, temperature, n] = clients(url, headers, n, temperature)
    return out


# --- the report -----------------------------------------------------------------------------

def row(what: str, theirs: float, mine: float, digits: int = 1) -> str:
    return f"| {what} | {theirs:.{digits}f} | {mine:.{digits}f} | {mine / theirs:.2f} |"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", nargs="+", default=["Q4_1", "Q8_0", "F32"], choices=list(QUANT))
    ap.add_argument("--parts", nargs="+", default=["decode", "prefill", "perplexity", "serving", "transformers"])
    ap.add_argument("--ctx", type=int, default=256, help="perplexity's chunk length")
    ap.add_argument("--eager-server", action="store_true", help="serve without handler.compile")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--measure", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        return measure(*a.measure[:2], a.measure[2], int(a.measure[3]), *a.measure[4:])
    lines = []
    with tempfile.TemporaryDirectory() as folder:
        files = formats(a.formats, folder)
        for name, path in files.items():
            quant = QUANT[name]
            lines.append(f"\n**{name}** (ours: QUANT={quant or 'none'})\n\n| measure | llama.cpp | ours | ratio |\n|---|---|---|---|")
            if "decode" in a.parts:
                for t in sorted({1, a.threads}):
                    theirs = llama_bench(path, t, 0, NEW_TOKENS)
                    for how in ("eager", "compiled"):
                        lines.append(row(f"decode, batch 1, {t} thread{'s' * (t > 1)}, ours {how} (tokens/s)",
                                         theirs, ours("decode", path, quant, t, how)))
            if "prefill" in a.parts:
                lines.append(row(f"prefill of 512 tokens, {a.threads} threads (tokens/s)",
                                 llama_bench(path, a.threads, 512, 0), ours("prefill", path, quant, a.threads)))
            if "perplexity" in a.parts:
                lines.append(row(f"perplexity, chunks of {a.ctx} (lower is better)",
                                 llama_perplexity(path, a.threads, a.ctx),
                                 ours("perplexity", path, quant, a.threads, a.ctx), 3))
            if "serving" in a.parts:
                served = serving(path, quant, a.threads, not a.eager_server)
                for temperature in (0.0, 0.7):
                    for n in (1, 8):
                        what = f"server{'' if a.eager_server else ' (ours compiled)'}, " \
                               f"{'one stream' if n == 1 else f'{n} clients'}, " \
                               f"{'greedy' if temperature == 0 else f'temperature {temperature}'} (output tokens/s)"
                        lines.append(row(what, served["llama.cpp", temperature, n], served["ours", temperature, n]))
            print("\n".join(lines[-8:]), flush=True)
        if "transformers" in a.parts:
            theirs = transformers_rate(SMOLLM2, a.threads)
            lines.append(f"\n**Against transformers** (the Q4_1 file; transformers: its GGUF loader, fp32; "
                         f"{a.threads} threads, batch 1, {NEW_TOKENS} tokens)\n\n| ours | transformers (tokens/s) | "
                         f"ours (tokens/s) | ratio |\n|---|---|---|---|")
            for quant in (None, "int8", "int4"):
                lines.append(row(f"QUANT={quant or 'none'}", theirs, ours("decode", SMOLLM2, quant, a.threads, "eager")))
            print("\n".join(lines[-5:]), flush=True)
    text = (f"## llama.cpp\n\nSmolLM2-135M-Instruct's GGUF file served by llama.cpp and by us, side by side. "
            f"{report.header()}; `python bench/llamacpp.py {' '.join(sys.argv[1:])}` at "
            f"{report_revision()}.\n\nllama.cpp: `llama-bench -m FILE -t T -p 0 -n 128` (decode), `-p 512 -n 0` "
            f"(prefill), `llama-perplexity -m FILE -f {os.path.relpath(TEXT, ROOT)} -c {a.ctx} -b {a.ctx}`, "
            f"`llama-server -m FILE -t {a.threads} -np 8 -c 4096`; built by `make llamacpp` (llama-cpp-python 0.3.36's "
            "vendored llama.cpp, GGML_NATIVE). Ours: the engine in-process (decode, prefill, perplexity) and "
            f"TorchServe with our handler at TP=1, {a.threads} threads, batchSize 8 (serving).\n" + "\n".join(lines))
    report.publish("llamacpp", text, write=not a.no_write)


def report_revision() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main()
