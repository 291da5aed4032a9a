"""Tensor parallelism's collectives on CPU: gloo against collectives.py's shared-memory
segment, measured in one run:

    python bench/cpu_collectives.py [--no-write]

1. One all-reduce of a decode step's activations (1 or 8 rows of dim 512, 8 rows of
   dim 4096, float32) between 2 and 4 ranks of this host (torchrun, 1 thread each): median
   microseconds, gloo (LLAMA_CPU_COLLECTIVES=gloo) and the segment (the default).
2. The in-process Engine's decode at TP=2 (1 thread per rank), 1 and 8 sequences, on
   bench/decode.py's 26M and 110M shapes (random weights): tokens/s and ms per step, gloo
   and the segment.

Writes the cpu_collectives section of BENCHMARKS.md (unless --no-write)."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import report
import serving_load as serving

ROOT = serving.ROOT
SHAPES = {"26M": (512, 8, 8), "110M": (768, 12, 12)}  # dim, layers, heads: bench/decode.py's
SIZES = ((1, 512), (8, 512), (8, 4096))  # rows x dim of an all-reduce
STEPS = 48


def torchrun(nproc: int, how: str, *args) -> dict:
    """This script as nproc ranks; rank 0's answer."""
    out = tempfile.mktemp(suffix=".json")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, LLAMA_CPU_COLLECTIVES=how)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                    __file__, "--rank", out, *args], env=env, check=True, capture_output=True)
    with open(out) as f:
        return json.load(f)


def rank_all_reduce() -> dict:
    import torch

    import collectives

    times = {}
    for rows, dim in SIZES:
        x = torch.randn(rows, dim)
        for _ in range(20):
            collectives.all_reduce(x)
        samples = []
        for _ in range(5):
            begin = time.perf_counter()
            for _ in range(100):
                collectives.all_reduce(x)
            samples.append((time.perf_counter() - begin) / 100 * 1e6)
        times[f"{rows}x{dim}"] = statistics.median(samples)
    return times


def rank_decode(ckpt: str) -> dict:
    import llama2
    from engine import Engine
    from sequence import SamplingParams

    llama = llama2.tp_llama(None, ckpt, None, int(os.environ["WORLD_SIZE"]), max_batch_size=8, max_seq_len=512)
    engine = Engine(llama.runner, llama.tokenizer)
    prompts = serving.make_prompts(8, 32, 32, serving.TOKENIZER, 0)
    out = {}
    for batch in (1, 8):
        seqs = [engine.add(llama.tokenizer.encode(p, bos=True, eos=False),
                           SamplingParams(max_gen_len=STEPS + 8, temperature=0, ignore_eos=True)) for p in prompts[:batch]]
        while any(not s.tokens for s in seqs):  # prefills and first tokens
            engine.step()
        for _ in range(4):
            engine.step()
        begin = time.perf_counter()
        for _ in range(STEPS):
            engine.step()
        seconds = time.perf_counter() - begin
        out[batch] = {"ms_per_step": seconds / STEPS * 1000, "tokens_per_s": batch * STEPS / seconds}
        for s in seqs:
            engine.release(s)
    return out


def rank_main(out: str, what: str, *args):
    import torch
    import torch.distributed as dist

    import tp

    torch.set_num_threads(1)
    tp.init_distributed(int(os.environ["WORLD_SIZE"]))
    result = rank_all_reduce() if what == "all_reduce" else rank_decode(*args)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def measure() -> dict:
    result = {"all_reduce": {}, "decode": {}}
    for world in (2, 4):
        for how in ("gloo", "shm"):
            result["all_reduce"][f"{world} {how}"] = torchrun(world, how, "all_reduce")
    with tempfile.TemporaryDirectory(prefix="bench_coll_") as tmp:
        for shape, (dim, layers, heads) in SHAPES.items():
            ckpt, _ = serving.write_checkpoint(os.path.join(tmp, shape), dim, layers, heads)
            for how in ("gloo", "shm"):
                result["decode"][f"{shape} {how}"] = torchrun(2, how, "decode", ckpt)
    return result


def section(r: dict) -> str:
    lines = [f"## Tensor parallelism on CPU: gloo against shared memory\n\n`python bench/cpu_collectives.py` — "
             f"{report.header()}; commit {serving.revision()}.\n\n"
             "Ranks under torchrun on this host, 1 thread each. *gloo*: torch.distributed's gloo over loopback sockets "
             "(LLAMA_CPU_COLLECTIVES=gloo); *segment*: collectives.py's shared-memory exchange (the default; tensors "
             "over 1 MB still go through gloo).\n\n"
             "### One all-reduce (float32), median of 5 × 100\n\n"
             "| ranks | rows × dim | gloo (µs) | segment (µs) | gloo / segment |\n|---|---|---|---|---|"]
    for world in (2, 4):
        gloo, shm = r["all_reduce"][f"{world} gloo"], r["all_reduce"][f"{world} shm"]
        for size in gloo:
            lines.append(f"| {world} | {size.replace('x', ' × ')} | {gloo[size]:.0f} | {shm[size]:.0f} | "
                         f"{gloo[size] / shm[size]:.1f} |")
    lines.append(f"\n### The in-process Engine decoding at TP=2 (greedy, {STEPS} steps after the prefills)\n\n"
                 "| model | sequences | gloo: ms per step / tokens/s | segment: ms per step / tokens/s | speed-up |\n"
                 "|---|---|---|---|---|")
    for shape in SHAPES:
        gloo, shm = r["decode"][f"{shape} gloo"], r["decode"][f"{shape} shm"]
        for batch in gloo:
            g, s = gloo[batch], shm[batch]
            lines.append(f"| {shape} | {batch} | {g['ms_per_step']:.1f} / {g['tokens_per_s']:.1f} | "
                         f"{s['ms_per_step']:.1f} / {s['tokens_per_s']:.1f} | "
                         f"{s['tokens_per_s'] / g['tokens_per_s']:.2f}× |")
    return "\n".join(lines) + "\n"


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        sys.path.insert(0, ROOT)
        return rank_main(*sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    a = ap.parse_args()
    report.publish("cpu_collectives", section(measure()), not a.no_write)


if __name__ == "__main__":
    main()
