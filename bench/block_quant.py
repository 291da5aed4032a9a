"""Microbenchmark of block_quant.py's kernels against torch's, on SmolLM2-135M's shapes:

    python bench/block_quant.py [--threads 1 2] [--rounds 5] [--shapes 576x3072 ...] [--rows 1 8 ...]
    python bench/block_quant.py --step [--threads 2] [--rows 4 6 8 12 16]

For each weight (in_features K, out_features N) and rows M of x, µs per call of:
  q4, q8        our kernels in fp32 (torch.ops.block_quant.linear_q4 / linear_q8, bf16_rows past 16)
  q4i8, q8i8    the same with x in int8 blocks (int8_x), summed in int32
  deq+linear    what BlockLinear does above KERNEL_MAX_ROWS: dequantize_q4 to LINEAR_DTYPE (bf16 with
                AVX512-BF16, else fp32) in slices, F.linear
  int4          torch's _weight_int4pack_mm_for_cpu (bf16 x, bf16 scales and zeros: QUANT=int4)
  int8          torch's _weight_int8pack_mm (bf16 x, one scale per output channel: QUANT=int8)
  fp32, bf16    F.linear on the weight in that dtype (converted once, before timing)
and at M=1 the GB/s our q4 kernel reads (packed weights, scales and offsets). Each round times
every variant once, one after the other (this machine is shared: interleaving spreads its load
over all of them); the table gives the median of the rounds. The bandwidth references: a copy
of 64 MB into an allocated tensor (read + written bytes) and a sum over it (read bytes).

--step: the projections of one SmolLM2 decode step instead, each of its 30 layers with weights of
its own (q/k/v, o, gate/up and down in q4, then in q8; the head in q8), so that they come from L3
or memory as in a real step, not from L2 as in a loop over one weight: ms of the kernels in fp32,
with x in int8 (int8_x) and in bf16 (AMX) at each number of rows, medians of the rounds.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import block_quant  # noqa: E402

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]  # SmolLM2: q/k/v, o, gate/up, down, vocab
ROWS = [1, 2, 4, 8, 16, 64, 512]
COLUMNS = ["q4", "q4i8", "q8", "q8i8", "deq+linear", "int4", "int8", "fp32", "bf16"]
FP32 = block_quant.KERNEL_MAX_ROWS + 1  # the kernels' bf16_rows: never in bf16


def seconds_per_call(f, budget: float = 0.02) -> float:
    """Seconds per call of f, over as many calls as fit in about budget seconds (at least 1)."""
    f()
    t0 = time.perf_counter()
    f()
    once = time.perf_counter() - t0
    n = max(1, int(budget / max(once, 1e-7)))
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n


def variants(K: int, N: int, M: int) -> dict:
    """The calls to time, on one random weight quantized for each kernel."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g) * 0.05
    q4, q8 = block_quant.BlockLinear.from_weight(w, 4), block_quant.BlockLinear.from_weight(w, 8)
    x = torch.randn(M, K, generator=g)
    xb = x.bfloat16()
    ops = torch.ops.block_quant
    # torch's int4: w = (q - 8) * scale + zero, scales and zeros bf16 (K/32, N, 2); ours' q and scale
    packed = q4.qweight.view(N, K // 32, 16)
    q = torch.stack([packed & 15, packed >> 4], -2).reshape(N, K)  # block_quant.cpp's nibble order
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)
    scale, offset = q4.scales.float(), q4.offsets.float()
    zeros = torch.stack([scale, offset + 8 * scale], -1).transpose(0, 1).contiguous().bfloat16()
    absmax = w.abs().amax(1)
    int8_scales = (absmax / 127).bfloat16()
    int8 = (w / int8_scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    w_bf16 = w.bfloat16()
    return {
        "q4": lambda: ops.linear_q4(x, q4.qweight, q4.scales, q4.offsets, FP32, False),
        "q4i8": lambda: ops.linear_q4(x, q4.qweight, q4.scales, q4.offsets, FP32, True),
        "q8": lambda: ops.linear_q8(x, q8.qweight, q8.scales, FP32, False),
        "q8i8": lambda: ops.linear_q8(x, q8.qweight, q8.scales, FP32, True),
        "deq+linear": lambda: q4.dequantized_linear(x),
        "int4": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, int4, 32, zeros),
        "int8": lambda: torch.ops.aten._weight_int8pack_mm(xb, int8, int8_scales),
        "fp32": lambda: F.linear(x, w),
        "bf16": lambda: F.linear(xb, w_bf16),
    }, q4


def bandwidth(rounds: int) -> tuple[float, float]:
    """GB/s of copying 64 MB into an allocated tensor (read + written) and of summing it (read)."""
    src = torch.ones(2**24)
    dst = torch.empty_like(src)
    copy = statistics.median(seconds_per_call(lambda: dst.copy_(src), 0.1) for _ in range(rounds))
    read = statistics.median(seconds_per_call(lambda: src.sum(), 0.1) for _ in range(rounds))
    return 2 * src.nbytes / copy / 1e9, src.nbytes / read / 1e9


def step_projections(rows: list[int], rounds: int):
    """Prints ms of a decode step's projections in each of the kernels' ways (see --step)."""
    g = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=g) * 0.05 for k, n in SHAPES[:4]] for _ in range(30)]
    layers = {bits: [[block_quant.BlockLinear.from_weight(w, bits) for w in layer] for layer in weights] for bits in (4, 8)}
    head = block_quant.BlockLinear.from_weight(torch.randn(SHAPES[4][1], SHAPES[4][0], generator=g) * 0.05, 8)
    modes = {"fp32": (FP32, False), "int8": (FP32, True), "bf16": (1, False)}  # bf16_rows, int8_x

    def call(m: block_quant.BlockLinear, x: torch.Tensor, mode: str):
        if m.bits == 4:
            return torch.ops.block_quant.linear_q4(x, m.qweight, m.scales, m.offsets, *modes[mode])
        return torch.ops.block_quant.linear_q8(x, m.qweight, m.scales, *modes[mode])

    parts = {"q4 layers": lambda xs, mode: [call(m, xs[m.in_features], mode) for layer in layers[4] for m in layer],
             "q8 layers": lambda xs, mode: [call(m, xs[m.in_features], mode) for layer in layers[8] for m in layer],
             "q8 head": lambda xs, mode: call(head, xs[head.in_features], mode)}
    print(f"ms, median of {rounds}; columns: " + ", ".join(f"{p} {m}" for p in parts for m in modes))
    for M in rows:
        xs = {k: torch.randn(M, k, generator=g) for k in (576, 1536)}
        ms = {}
        for _ in range(rounds):
            for part, f in parts.items():
                for mode in modes:
                    t0 = time.perf_counter()
                    f(xs, mode)
                    ms.setdefault((part, mode), []).append((time.perf_counter() - t0) * 1e3)
        print(f"{M:>4} " + " ".join(f"{statistics.median(v):>7.2f}" for v in ms.values()), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", default=[f"{k}x{n}" for k, n in SHAPES], help="KxN")
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS)
    parser.add_argument("--step", action="store_true", help="a decode step's projections, fp32 against bf16 kernels")
    args = parser.parse_args()
    block_quant.load()
    if args.step:
        if not torch.ops.block_quant.amx():
            sys.exit("--step compares the kernels in bf16, which takes AMX")
        for threads in args.threads:
            torch.set_num_threads(threads)
            print(f"\n{threads} thread(s)")
            step_projections(args.rows, args.rounds)
        return
    for threads in args.threads:
        torch.set_num_threads(threads)
        copy, read = bandwidth(args.rounds)
        print(f"\n{threads} thread(s): 64 MB copy {copy:.1f} GB/s (read + written), sum {read:.1f} GB/s (read); "
              f"µs per call, median of {args.rounds} rounds")
        print(f"{'K':>5} {'N':>6} {'M':>4} " + " ".join(f"{c:>9}" for c in COLUMNS) + "  q4 GB/s  q4/int4")
        for shape in args.shapes:
            K, N = map(int, shape.split("x"))
            for M in args.rows:
                calls, q4 = variants(K, N, M)
                times = {c: [] for c in COLUMNS}
                for _ in range(args.rounds):
                    for c in COLUMNS:
                        times[c].append(seconds_per_call(calls[c]))
                us = {c: statistics.median(t) * 1e6 for c, t in times.items()}
                line = f"{K:>5} {N:>6} {M:>4} " + " ".join(f"{us[c]:>9.1f}" for c in COLUMNS)
                if M == 1:
                    nbytes = q4.qweight.nbytes + q4.scales.nbytes + q4.offsets.nbytes
                    line += f"  {nbytes / us['q4'] / 1e3:>7.1f}"
                else:
                    line += " " * 9
                print(line + f"  {us['int4'] / us['q4']:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
