"""Decode speed on CPU, at batch 1 and 8 (prompt of 32 tokens, 64 new tokens, greedy):

    python bench/decode.py [--reps 5] [--models 26M 110M] [--no-tp] [--no-write]

1. In this process: generate.generate (the public API) and the raw decode step
   (Transformer.forward of one token per row), side by side with transformers' generate on
   the same weights (KV cache on, do_sample=False, min_new_tokens=64), and against the
   roofline: bytes of weights read per step / memory bandwidth, the bandwidth measured
   here by copying a 1 GiB tensor. Both must produce the same greedy tokens (a warning
   says when they do not). The same with the weights quantized to int8 and int4
   (tp_llama(quantization=...), quant.py), whose roofline counts their quantized bytes;
   the quantization targets are printed as ratios measured in the same run.
2. Under torchrun (bench/tp_decode.py; shared memory, or gloo with LLAMA_CPU_COLLECTIVES=gloo): TP=1 and TP=2 with 1 or 2 threads per rank
   (OMP_NUM_THREADS, which TorchServe sets from model-config.yaml), the time of a step's
   collectives, and, at TP=2, our plain sharding against torch's DTensor.

The models are random Llamas written by tools/make_checkpoint.py (transformers'
LlamaForCausalLM, saved in Meta's layout and loaded by llama2.tp_llama), fp32, with
demo/tokenizer.model's vocabulary. The tables go into BENCHMARKS.md between
the decode markers.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
import generate  # noqa: E402
import llama2  # noqa: E402
import make_checkpoint  # noqa: E402
import quant  # noqa: E402
import report  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402
from tp_decode import (BATCHES, NEW, PROMPT_LEN, NoEos, generate_tokens_per_s, median_time, prompts,  # noqa: E402
                       step_bytes, step_ms)

TOKENIZER = os.path.join(ROOT, "demo", "tokenizer.model")
MODELS = {"26M": (512, 8, 8), "110M": (768, 12, 12)}  # dim, layers, heads (= KV heads); named as in the issue
TP_CONFIGS = [(1, 1), (1, 2), (2, 1), (2, 2)]  # (ranks, threads per rank)


def copy_bandwidth(threads: int) -> float:
    """GB/s of a 1 GiB tensor copy, counting the bytes read and written (STREAM's copy)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    src = torch.ones(2**28)
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), 7)
    torch.set_num_threads(saved)
    return 2 * src.numel() * src.element_size() / t / 1e9


def matmul_ms(model: llama2.Transformer, batch: int) -> float:
    """Median time of the matrix products of one decode step alone: every linear layer's
    weight times a (batch, in_features) input, one after another, as the step does them."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in weights}

    return median_time(lambda: [torch.nn.functional.linear(inputs[w.shape[1]], w) for w in weights], NEW) * 1e3


def cold_op_us() -> tuple[float, float]:
    """Microseconds of one small operation (a multiply of 512 floats) with warm caches, and
    right after a matrix product has streamed 5.6 MB of weights through them."""
    x, w, weight = torch.randn(1, 512), torch.randn(512), torch.randn(2752, 512)
    warm, cold = [], []
    for _ in range(200):
        start = time.perf_counter()
        x * w
        warm.append(time.perf_counter() - start)
        torch.nn.functional.linear(x, weight)
        start = time.perf_counter()
        x * w
        cold.append(time.perf_counter() - start)
    return statistics.median(warm) * 1e6, statistics.median(cold) * 1e6


def build(name: str, out: str):
    dim, layers, heads = MODELS[name]
    hf = make_checkpoint.random_hf_model(dim, layers, heads, heads, Tokenizer(TOKENIZER).n_words, seed=0)
    folder = make_checkpoint.write_layouts(hf, out, TOKENIZER, ["meta:1"])["meta:1"]
    return hf, folder


def hf_generate(hf, batch_prompts: list[list[int]]) -> list[list[int]]:
    ids = torch.tensor(batch_prompts)
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, use_cache=True,
                          max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0, eos_token_id=2)
    return out[:, PROMPT_LEN:].tolist()


def same_greedy(ours: list[list[int]], theirs: list[list[int]], eos: int) -> str:
    """yes, or "up to EOS" when the rows agree up to where ours chose EOS (transformers'
    min_new_tokens forbids it, so its tokens go another way from there), or no."""
    for a, b in zip(ours, theirs):
        n = a.index(eos) if eos in a else len(a)
        if a[:n] != b[:n]:
            return "no"
    return "yes" if ours == theirs else "up to EOS"


def in_process(name: str, hf, folder: str, reps: int) -> dict:
    """Rows of the main table: transformers, then ours in each VARIANTS, on the same weights."""
    def load(quantization):
        return llama2.tp_llama(None, folder, TOKENIZER, 1, max_batch_size=max(BATCHES), max_seq_len=PROMPT_LEN + NEW,
                               quantization=quantization)

    llama = load(None)
    runner = llama.runner
    result = {"params": sum(p.numel() for p in llama.model.parameters()), "step_bytes": {}, "compile_s": {},
              "rows": {b: {} for b in BATCHES}}
    reference = {}
    for batch in BATCHES:
        p = prompts(batch, runner.vocab_size)
        reference[batch] = hf_generate(hf, p)
        t = median_time(lambda: hf_generate(hf, p), reps)
        result["rows"][batch]["transformers"] = {"tokens_s": batch * NEW / t}
    for batch in BATCHES:
        result["rows"][batch]["matmul_ms"] = matmul_ms(llama.model, batch)
    for variant, _, quantization, compiled in VARIANTS:
        if quantization is not None and not compiled:  # each quantization's eager variant comes first
            runner = load(quantization).runner
        result["step_bytes"][quantization] = step_bytes(runner.model)
        if compiled:
            start = time.perf_counter()
            runner.compile_decode()  # compiles its three graphs before it returns
            result["compile_s"][quantization] = time.perf_counter() - start
        tokenizer = NoEos(llama.tokenizer)
        for batch in BATCHES:
            p = prompts(batch, runner.vocab_size)
            same = same_greedy(generate.generate(runner, p, NEW, temperature=0.0, tokenizer=tokenizer)[0],
                               reference[batch], llama.tokenizer.eos_id)
            if same == "no" and quantization is None:
                print(f"WARNING: {name} batch {batch} {variant}: our greedy tokens differ from transformers'",
                      file=sys.stderr)
            result["rows"][batch][variant] = {
                "tokens_s": generate_tokens_per_s(runner, tokenizer, batch, reps), "same_tokens": same,
                "step_ms": step_ms(runner, batch),
                "staggered_ms": step_ms(runner, batch, staggered=True) if batch > 1 else None}
    print(f"{name}: {result}", file=sys.stderr)
    return result


def tp_run(folder: str, ranks: int, threads: int, reps: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               os.path.join(ROOT, "bench", "tp_decode.py"), folder, out.name, "--reps", str(reps)]
        if ranks > 1 and threads == 1:
            cmd.append("--dtensor")
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        result = json.load(open(out.name))
    print(f"TP={ranks} x {threads} threads: {result}", file=sys.stderr)
    return result


# --- the BENCHMARKS.md section -----------------------------------------------------------

def fmt(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


# (key, title, quantization, compile_decode)
VARIANTS = (("eager", "ours", None, False), ("compiled", "ours, compile_decode()", None, True),
            ("int8", "ours, int8", "int8", False), ("int8_compiled", "ours, int8, compile_decode()", "int8", True),
            ("int4", "ours, int4", "int4", False), ("int4_compiled", "ours, int4, compile_decode()", "int4", True))


def section(info: str, bw: dict, cold: tuple, results: dict, tp: dict, elapsed: float) -> str:
    threads, vocab = torch.get_num_threads(), Tokenizer(TOKENIZER).n_words
    lines = [
        "## Decode speed on CPU",
        "",
        f"`make bench` (bench/decode.py, {elapsed / 60:.0f} min) — {info}.",
        "",
        f"Memory bandwidth, 1 GiB tensor copy (bytes read + written): **{fmt(bw[threads], 1)} GB/s** with "
        f"{threads} threads, {fmt(bw[1], 1)} GB/s with 1. *Roofline* = that bandwidth / the bytes of weights a "
        "step reads (all but the embedding table), times the batch: the tokens/s if the weights streamed from "
        "memory once per step and nothing else took time.",
        "",
        f"Prompts of {PROMPT_LEN} tokens, {NEW} new tokens each, greedy, fp32, random weights "
        f"(tools/make_checkpoint.py, seed 0), the vocabulary of demo/tokenizer.model ({vocab} tokens; "
        + ", ".join(f"{name} has {r['params'] / 1e6:.1f}M parameters" for name, r in results.items())
        + "). "
        "tokens/s = batch × 64 / wall time of the whole call, prefill included; median of the repetitions after "
        "a warm-up. *ours* is generate.generate, eager or after ModelRunner.compile_decode(); *transformers* is "
        "LlamaForCausalLM.generate on the same weights (use_cache=True, do_sample=False, min_new_tokens=64). "
        "*step* is one Transformer.forward of one token per row (median over positions 32–95); *staggered*: "
        "row i is i positions behind row 0, as sequences that started at different times are (a mask, and "
        "indexed writes to the KV cache). Greedy tokens are compared with transformers' up to the first EOS "
        "that ours picks (min_new_tokens forbids it to transformers). *int8*, *int4*: the same checkpoint "
        "quantized at load (tp_llama(quantization=...), quant.py: int8 per output channel, int4 in groups of "
        f"{quant.INT4_GROUP_SIZE}, the output projection in int8 in both); their roofline counts their quantized "
        "bytes (MB/step), and their greedy tokens may part from transformers' fp32 ones.",
        "",
        "| model | batch | implementation | tokens/s | × transformers | of the roofline | step (ms) | "
        "staggered step (ms) | same greedy tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        label = f"{name} ({r['step_bytes'][None] / 1e6:.0f} MB/step)"
        for batch, row in r["rows"].items():
            hf = row["transformers"]["tokens_s"]
            roof = bw[threads] * 1e9 / r["step_bytes"][None]
            lines.append(f"| {label} | {batch} | transformers | {fmt(hf)} | 1 | {100 * hf / (batch * roof):.0f}% "
                         "| | | |")
            for variant, title, quantization, _ in VARIANTS:
                v = row[variant]
                roof = bw[threads] * 1e9 / r["step_bytes"][quantization]
                if quantization:
                    title += f" ({r['step_bytes'][quantization] / 1e6:.0f} MB/step)"
                staggered = "" if v["staggered_ms"] is None else f"{v['staggered_ms']:.2f}"
                same = v["same_tokens"] if v["same_tokens"] != "no" else "**no**"
                lines.append(f"| {label} | {batch} | {title} | **{fmt(v['tokens_s'])}** | "
                             f"{v['tokens_s'] / hf:.2f} | {100 * v['tokens_s'] / (batch * roof):.0f}% | "
                             f"{v['step_ms']:.2f} | {staggered} | {same} |")
    lines += ["", "Targets: at batch 1 on the 26M model, ≥ 2× transformers and ≥ 60% of the roofline; at batch 8, "
              "≥ 5× batch 1's tokens/s.", ""]
    for name, r in results.items():
        for variant, title, quantization, _ in VARIANTS:
            roof = bw[threads] * 1e9 / r["step_bytes"][quantization]
            one, eight = r["rows"][1][variant]["tokens_s"], r["rows"][8][variant]["tokens_s"]
            lines.append(f"- {name}, {title}: {one / r['rows'][1]['transformers']['tokens_s']:.2f}× transformers "
                         f"and {100 * one / roof:.0f}% of the roofline at batch 1; batch 8 gives {eight / one:.1f}× "
                         "batch 1's tokens/s.")
    lines += ["", "Quantization targets: at batch 1 on the 110M model, int8 ≥ 1.6× ours in fp32 (eager) and ≥ 2× "
              "transformers; at batch 8, int8 no slower than fp32. Ratios of this run (tokens/s):", ""]
    for name, r in results.items():
        speed = {b: {k: v["tokens_s"] for k, v in r["rows"][b].items() if isinstance(v, dict)} for b in BATCHES}
        for variant, title, quantization, compiled in VARIANTS:
            if quantization:
                fp32 = "compiled" if compiled else "eager"
                lines.append(f"- {name}, {title}: batch 1 {speed[1][variant] / speed[1][fp32]:.2f}× ours in fp32 "
                             f"({fp32}) and {speed[1][variant] / speed[1]['transformers']:.2f}× transformers; batch 8 "
                             f"{speed[8][variant] / speed[8][fp32]:.2f}× ours in fp32 ({fp32}).")
    lines += ["", "Where the time goes:", ""]
    for name, r in results.items():
        one, eight = r["rows"][1], r["rows"][8]
        m1, m8 = one["matmul_ms"], eight["matmul_ms"]
        lines.append(
            f"- {name}: the matrix products of a step alone (F.linear on every weight, MKL) take {m1:.2f} ms at "
            f"batch 1 ({r['step_bytes'][None] / m1 / 1e6:.1f} GB/s; the eager step takes "
            f"{one['eager']['step_ms']:.2f} ms, "
            f"the compiled one {one['compiled']['step_ms']:.2f} ms) and {m8:.2f} ms at batch 8: MKL's products "
            f"with 8 rows run at {m1 / m8 * 100:.0f}% of the bytes/s of the 1-row ones, so even a step of nothing "
            f"but products would give batch 8 only {8 * m1 / m8:.1f}× batch 1's tokens/s.")
    lines.append(
        f"- The rest of an eager step is about 25 small operations per layer (norms, rotation, cache writes, "
        f"attention, SiLU, residual adds), and each costs far more than its arithmetic because the weights that "
        f"stream through the caches between them evict the interpreter's and the operators' own data: a multiply "
        f"of 512 floats takes {cold[0]:.1f} µs with warm caches and {cold[1]:.1f} µs right after a 5.6 MB matrix "
        f"product. compile_decode() fuses them into a few kernels per layer; compiling "
        + ", ".join(f"{name} took {r['compile_s'][None]:.0f} s" for name, r in results.items())
        + " (three graphs: one row, several rows at one position, rows at different positions; dynamic "
          "shapes, so the growing KV length does not recompile).")
    if tp:
        lines += tp_section(tp)
    return "\n".join(lines) + "\n"


def tp_section(tp: dict) -> list[str]:
    lines = [
        "",
        "### Tensor parallelism on CPU: TP=1 against TP=2, and threads per rank",
        "",
        "Each configuration runs bench/tp_decode.py under torchrun (collectives.py's shared-memory "
        "segment, or gloo where LLAMA_CPU_COLLECTIVES=gloo), eager, with OMP_NUM_THREADS as "
        "TorchServe sets it from model-config.yaml's `torchrun: OMP_NUMBER_THREADS`. *collectives*: the time of "
        "one step's collectives on their own (2 all-reduces of batch × dim floats per layer, and the all-gather "
        "of the logits), the ranks starting them together.",
        "",
        "| model | TP × threads per rank | tokens/s, batch 1 | tokens/s, batch 8 | step, batch 1 (ms) | "
        "step, batch 8 (ms) | collectives, batch 1 (ms/step) | collectives, batch 8 (ms/step) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in tp.items():
        for r in runs:
            comm = " | ".join(f"{r['comm_ms'][b]:.2f}" if "comm_ms" in r else "–" for b in ("1", "8"))
            lines.append(f"| {name} | {r['tp']} × {r['threads']} | {fmt(r['generate']['1'])} | "
                         f"{fmt(r['generate']['8'])} | {r['step_ms']['1']:.2f} | {r['step_ms']['8']:.2f} | {comm} |")
    lines += ["", "Best OMP_NUM_THREADS (`OMP_NUMBER_THREADS` in model-config.yaml) on this machine, by tokens/s:", ""]
    for name, runs in tp.items():
        for ranks in sorted({r["tp"] for r in runs}):
            for batch in ("1", "8"):
                best = max((r for r in runs if r["tp"] == ranks), key=lambda r: r["generate"][batch])
                lines.append(f"- {name}, TP={ranks}, batch {batch}: {best['threads']} "
                             f"({fmt(best['generate'][batch])} tokens/s)")
    lines += [
        "",
        "### TP=2: plain sharding against DTensor",
        "",
        "Decode step (ms) at TP=2 with 1 thread per rank. *ours*: llama2.py (fused wqkv and w13, local tensors, "
        "collectives.all_reduce). *separate, plain*: the same model written with separate wq/wk/wv/w1/w3 "
        "(torchtitan's layout), local slices and collectives.all_reduce. *separate, DTensor*: that model through parallelize_module "
        "(ColwiseParallel for wq/wk/wv/w1/w3 and the output, RowwiseParallel for wo/w2). Max |Δ logits|: "
        "against ours, on a 32-token prefill.",
        "",
        "| model | ours, batch 1 | ours, batch 8 | separate, plain, batch 1 | separate, plain, batch 8 | "
        "separate, DTensor, batch 1 | separate, DTensor, batch 8 | max abs Δ logits, plain / DTensor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in tp.items():
        d = next((r["dtensor"] for r in runs if "dtensor" in r), None)
        if d:
            lines.append(f"| {name} | {d['ours']['1']:.2f} | {d['ours']['8']:.2f} | {d['plain']['1']:.2f} | "
                         f"{d['plain']['8']:.2f} | {d['dtensor']['1']:.2f} | {d['dtensor']['8']:.2f} | "
                         f"{d['plain_max_diff']:.1e} / {d['dtensor_max_diff']:.1e} |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--no-tp", action="store_true", help="skip the torchrun runs")
    ap.add_argument("--no-write", action="store_true", help="print the section, leave BENCHMARKS.md alone")
    a = ap.parse_args()
    start = time.perf_counter()
    info = (f"{report.header()}, "
            f"{torch.get_num_threads()} threads in this process")
    bw = {n: copy_bandwidth(n) for n in sorted({1, torch.get_num_threads()})}
    cold = cold_op_us()
    print(f"bandwidth {bw}, small op warm / cold {cold}", file=sys.stderr)
    results, tp = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models:
            hf, folder = build(name, os.path.join(tmp, name))
            results[name] = in_process(name, hf, folder, a.reps)
            del hf
            if not a.no_tp:
                tp[name] = [tp_run(folder, ranks, threads, a.reps) for ranks, threads in TP_CONFIGS]
    text = section(info, bw, cold, results, tp, time.perf_counter() - start)
    report.publish("decode", text, not a.no_write)


if __name__ == "__main__":
    main()
