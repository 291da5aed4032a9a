"""Weight-only block-quantized linear layers for the CPU, on our own kernels (block_quant.cpp),
with the numbers of GGUF's Q4_0, Q4_1 and Q8_0 files: 32 weights a block, each block with its
fp16 scale (and offset). The kernels multiply x by exactly the weights dequantize() returns
(rounded to bf16 where they compute in bf16), so a Q4_1 file's layer computes the file's own weights.

BlockLinear(...)(x) computes up to KERNEL_MAX_ROWS rows of x with the kernels, which pick by
the rows (a decode step's sequences, a prompt's tokens):
  below BF16_ROWS (by format), in fp32: x times the weights; or, where INT8_X is on
    (handler.int8_activations) and the CPU has AVX512-VNNI, each block of 32 of x rounded to int8
    with its own scale (Q8_0's), as llama.cpp's CPU backend does, the products summed in int32
    and scaled in fp32;
  from BF16_ROWS, on a CPU with AMX, in bf16: x and the weights rounded to bf16, products
    summed in fp32, in tile products that dequantize each weight once for all rows;
and above KERNEL_MAX_ROWS dequantizes the weight for F.linear (oneDNN), in LINEAR_DTYPE: bf16
where the CPU multiplies bf16 itself (AVX512-BF16; AMX), fp32 elsewhere. So with AMX a row is
computed in bf16 from BF16_ROWS rows on, as a long prompt always was; without AVX512-BF16, in fp32.
The ops (torch.ops.block_quant.*) are built on first use by torch.utils.cpp_extension, cached
across processes in TORCH_EXTENSIONS_DIR, and have fake implementations for torch.compile.
"""

import os
import threading

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import cpp_ops

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "block_quant.cpp")
CFLAGS = list(cpp_ops.CFLAGS)
BLOCK = 32  # weights per block (and its scale)
# Rows of x up to which forward() runs the kernels; above, dequantizing to bf16 and F.linear
# (oneDNN, AMX) is faster. bench/block_quant.py on an idle machine, median µs,
# q4 kernel / bf16_linear, 1 thread | 2 threads:
#   rows   576x960    576x576    576x3072   1536x576   576x49152   (K x N)
#    12   149 / 235   87 / 138  430 / 610  217 / 385   7338 / 9597  |  78 / 128  52 / 107  242 / 387  117 / 225  3811 / 9658
#    16   171 / 176  104 / 120  558 / 665  267 / 353   9198 / 9581  |  94 / 119  66 / 103  282 / 296  150 / 224  5078 / 7281
#    20   220 / 181  138 / 136  730 / 736  336 / 386  11525 / 20443 | 118 / 143  78 / 97   371 / 323  183 / 211  6163 / 6838
# (q8 is ~10 % slower than q4 there.)
KERNEL_MAX_ROWS = 16
# Rows of x from which the kernels are faster in bf16 than in fp32, by bits, in a decode step,
# where the weights come from L3 (`python bench/block_quant.py --step`, 2 threads, ms of
# SmolLM2's projections, fp32 / bf16; in a loop over one weight, from L2, bf16 wins from 6 rows,
# by up to 1.7x at 8). q8 blocks take more work to make bf16 (no 16-level table), so later:
#   rows   30 layers' q4   30 layers' q8   head q8
#     6    8.66 / 8.59                    2.15 / 2.53
#     8   10.42 / 8.51     9.45 / 10.44   2.58 / 2.50
#    10                   12.75 / 11.35
#    12   15.55 / 10.22   14.24 / 11.11   4.13 / 2.89
# Against x in int8 blocks (int8_x, below), which takes the rows under BF16_ROWS (three runs,
# 2026-12-06 11:30 UTC, ms, int8_x / bf16): 30 layers' q4 at 7 rows 10.56 / 9.84, 12.80 / 11.39,
# 11.02 / 10.05 (at 6 even); the q8 head at 8 rows 3.14 / 2.55, 3.93 / 3.89, 3.22 / 2.58, with
# the q8 layers even there (13.55 / 13.55, 17.15 / 17.03, 13.22 / 13.49) and int8_x's at 7.
BF16_ROWS = {4: 7, 8: 8}
# x in int8 blocks below BF16_ROWS (where there is VNNI): a decode step's projections at batch 1,
# SmolLM2 (`python bench/block_quant.py --step`, 2 threads, ms, fp32 / int8): 30 layers in q4
# 5.34 / 4.34, in q8 7.96 / 6.53, the q8 head 1.79 / 1.41; the same at 4 and 8 rows. Off unless
# handler.int8_activations (loading.py sets it for the worker): rounding x makes a row's sums
# tip on last bits, so that a compiled worker's greedy answer can part from eager's at no near
# tie (docs/quantization.md), where with x in fp32 their margins agree within 1.3e-5.
INT8_X = False
# F.linear's dtype above KERNEL_MAX_ROWS. oneDNN's bf16 products are its own instructions only
# with AVX512-BF16 (or AMX); elsewhere it converts, and fp32 is faster: on an AMD EPYC with AVX2
# alone, 64 rows times a 256 x 32000 weight took 124 ms in bf16 against 20 ms in fp32.
LINEAR_DTYPE = torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() else torch.float32
# Weights dequantized at once on the F.linear path: 2M of them (4 MB of bf16), which the allocator reuses and
# the caches hold. A whole 576 x 49152 output projection (57 MB) took 35 ms for 16 rows, against
# 9 ms in slices, most of it page faults of the fresh buffer.
DEQUANTIZE_SLICE = 2**21

# GGUF's block formats: bytes per block of 32 weights; each block starts with its fp16 scale d
# (Q4_1: then its fp16 offset m), then the weights (Q4: 16 bytes of nibbles, GGUF's order is ours).
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}

_lock = threading.Lock()
_loaded = False


def load():
    """Build block_quant.cpp (cpp_ops.build: once, cached across processes) and load its ops,
    with their fake implementations. ValueError when the machine lacks what building takes."""
    global _loaded
    with _lock:
        if _loaded:
            return
        cpp_ops.build(SOURCE, "the block-quantized layers' CPU kernels", CFLAGS)
        register_fakes()
        _loaded = True


def register_fakes():
    """Output shapes for torch.compile, which traces the ops without running them."""
    def linear(x, qweight, *rest):
        return x.new_empty(x.shape[0], qweight.shape[0])

    def dequantize(qweight, scales, *rest):
        dtype = rest[-1]
        return qweight.new_empty(qweight.shape[0], scales.shape[1] * BLOCK, dtype=dtype)

    for name, fake in (("linear_q4", linear), ("linear_q8", linear),
                       ("dequantize_q4", dequantize), ("dequantize_q8", dequantize)):
        torch.library.register_fake(f"block_quant::{name}", fake)


class BlockLinear(nn.Module):
    """y = x @ w.T with w (out_features, in_features) in blocks of 32 input channels:
    bits=4: qweight uint8 (out, in/2), w = scales * q + offsets, q in 0..15 (nibble layout:
    block_quant.cpp); bits=8: qweight int8 (out, in), w = scales * q. scales and offsets are
    fp16 (out, in/32)."""

    def __init__(self, bits: int, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None = None):
        super().__init__()
        if bits not in (4, 8) or (offsets is None) != (bits == 8):
            raise ValueError(f"BlockLinear takes bits=4 with offsets or bits=8 without, got bits={bits}")
        packed = torch.uint8 if bits == 4 else torch.int8
        if qweight.dtype != packed or any(t.dtype != torch.float16 for t in (scales, offsets) if t is not None):
            raise ValueError(f"BlockLinear bits={bits} takes {packed} weights and float16 scales")
        load()
        self.bits = bits
        self.out_features, self.in_features = scales.shape[0], scales.shape[1] * BLOCK
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("offsets", None if offsets is None else offsets.contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= KERNEL_MAX_ROWS:
            if self.bits == 4:
                out = torch.ops.block_quant.linear_q4(x2.float(), self.qweight, self.scales, self.offsets,
                                                      BF16_ROWS[4], INT8_X)
            else:
                out = torch.ops.block_quant.linear_q8(x2.float(), self.qweight, self.scales, BF16_ROWS[8], INT8_X)
        else:
            out = self.dequantized_linear(x2)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def dequantized_linear(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, in) @ w.T in LINEAR_DTYPE, by F.linear on the weight dequantized in slices of rows."""
        xd, step = x.to(LINEAR_DTYPE), max(1, DEQUANTIZE_SLICE // self.in_features)
        return torch.cat([F.linear(xd, self.dequantize(LINEAR_DTYPE, slice(n, n + step)))
                          for n in range(0, self.out_features, step)], -1)

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: slice = slice(None)) -> torch.Tensor:
        """The weight (out_features, in_features) the kernels compute with (float32), or it
        rounded to bfloat16; rows: those rows only."""
        if self.bits == 4:
            return torch.ops.block_quant.dequantize_q4(self.qweight[rows], self.scales[rows], self.offsets[rows], dtype)
        return torch.ops.block_quant.dequantize_q8(self.qweight[rows], self.scales[rows], dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"

    @classmethod
    @torch.no_grad()
    def from_weight(cls, w: torch.Tensor, bits: int) -> "BlockLinear":
        """Quantize a float weight (out, in) in blocks of 32 input channels: bits=4 as GGUF's Q4_1
        (scale (max - min) / 15, offset min), bits=8 as Q8_0 (scale absmax / 127). The scales are
        rounded to fp16 first, so that q fits the numbers the kernels use."""
        out_features, in_features = w.shape
        if in_features % BLOCK:
            raise ValueError(f"block quantization needs in_features divisible by {BLOCK}, got {in_features}")
        blocks = w.detach().to("cpu", torch.float32).reshape(out_features, in_features // BLOCK, BLOCK)
        lo, hi = blocks.aminmax(dim=-1)
        if bits == 4:
            scales, offsets = ((hi - lo) / 15).half(), lo.half()
            q = (blocks - offsets.float()[..., None]) / scales.float()[..., None]
            q = q.nan_to_num_(0).round_().clamp_(0, 15).to(torch.uint8)  # 0/0: a constant block
            qweight = (q[..., :16] | q[..., 16:] << 4).reshape(out_features, in_features // 2)
        elif bits == 8:
            scales, offsets = (torch.maximum(-lo, hi) / 127).half(), None
            q = (blocks / scales.float()[..., None]).nan_to_num_(0).round_().clamp_(-127, 127)
            qweight = q.to(torch.int8).reshape(out_features, in_features)
        else:
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        if not torch.isfinite(scales).all():
            raise ValueError("a block's scale does not fit in float16")
        return cls(bits, qweight, scales, offsets)

    @classmethod
    def from_gguf(cls, qtype, raw: np.ndarray, rows: int, cols: int,
                  columns: tuple[int, int] | None = None) -> "BlockLinear":
        """A GGUF tensor's rows as they are stored: raw, uint8 (rows, bytes per row) as
        gguf.GGUFReader's tensor.data (or a slice of its rows), of a weight (rows, cols) in
        qtype Q4_0 (w = d * (q - 8)), Q4_1 (w = d * q + m) or Q8_0 (w = d * q), a
        gguf.GGMLQuantizationType or its name. columns=(start, end), multiples of 32: only those
        input channels (a tensor-parallel shard). The file's numbers are kept exactly."""
        name = getattr(qtype, "name", qtype)
        if name not in GGUF_BLOCK_BYTES:
            raise ValueError(f"BlockLinear reads GGUF tensors of types {', '.join(GGUF_BLOCK_BYTES)}, not {name}")
        start, end = columns or (0, cols)
        if cols % BLOCK or start % BLOCK or end % BLOCK or not 0 <= start < end <= cols:
            raise ValueError(f"columns {start}..{end} of {cols} must be multiples of {BLOCK} and in range")
        size = GGUF_BLOCK_BYTES[name]
        if raw.dtype != np.uint8 or raw.shape != (rows, cols // BLOCK * size):
            raise ValueError(f"a {name} tensor of {rows} x {cols} is uint8 ({rows}, {cols // BLOCK * size}), "
                             f"got {raw.dtype} {tuple(raw.shape)}")
        blocks = raw.reshape(rows, cols // BLOCK, size)[:, start // BLOCK:end // BLOCK]
        d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
        if name == "Q8_0":
            qweight = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, end - start)
            return cls(8, torch.from_numpy(qweight), torch.from_numpy(d))
        if name == "Q4_1":
            offsets = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
        else:
            with np.errstate(over="ignore"):
                offsets = d * np.float16(-8)  # exact in fp16 (a power of 2) unless it overflows
            if not np.isfinite(offsets).all():
                raise ValueError("a Q4_0 block's scale is too large: -8 * d overflows float16")
        qweight = np.ascontiguousarray(blocks[..., size - 16:]).reshape(rows, (end - start) // 2)
        return cls(4, torch.from_numpy(qweight), torch.from_numpy(d), torch.from_numpy(offsets))

    @classmethod
    def cat(cls, layers: list["BlockLinear"]) -> "BlockLinear":
        """One layer whose output channels are those of layers in turn (a fused q/k/v or gate/up
        projection from several GGUF tensors)."""
        bits, in_features = layers[0].bits, layers[0].in_features
        if any(m.bits != bits or m.in_features != in_features for m in layers):
            raise ValueError("BlockLinear.cat needs layers of one bit width and one in_features")
        return cls(bits, torch.cat([m.qweight for m in layers]), torch.cat([m.scales for m in layers]),
                   None if bits == 8 else torch.cat([m.offsets for m in layers]))
