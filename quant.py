"""Quantized linear layers: weight-only int8 (symmetric, one scale per output channel) and
int4 (one scale and zero per group of input channels), FP8 (e4m3 weights with one scale per
output channel, activations quantized per token as they come, for GPUs that multiply FP8),
and quantize(), which puts them into a sharded Transformer in place, one projection at a time.

On the CPU, int8 and int4 layers are block_quant.BlockLinear (our kernels, blocks of 32 input
channels as GGUF's Q8_0 and Q4_1, fp32 activations), made from a GGUF file's own blocks where it
has them in the mode's kind (Q8_0; Q4_0, Q4_1), so that they compute the file's numbers.
Elsewhere, the kernels, chosen per device by measurement (bench/decode.py, BENCHMARKS.md; the
CPU branches below serve the GPU check's CPU dry run):
- int8 on CPU: aten._weight_int8pack_mm, fed bf16 activations (its fp32 path is a scalar loop).
- int8 on CUDA: F.linear(x, w.to(x.dtype)) * scales, which torch.compile fuses into one kernel
  reading int8 weights (gpt-fast's way). The scales stay fp32 there: with bf16 scales inductor
  rewrites the expression into _weight_int8pack_mm, whose CUDA kernel is naive.
- int4: aten._weight_int4pack_mm (CUDA, tinygemm) and _weight_int4pack_mm_for_cpu, bf16 activations.
- fp8: torch._scaled_mm with row-wise scales (CUDA, compute capability 8.9+ only: refused elsewhere).
Their weight layouts differ, so a layer is quantized on the device it runs on and stays there.
"""

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from block_quant import BLOCK, GGUF_BLOCK_BYTES, BlockLinear
from model import to_empty

MODES = ("int8", "int4", "fp8")
FP8_MAX = 448.0  # the largest float8_e4m3fn
FP8_CAPABILITY = (8, 9)  # the first CUDA GPUs (Ada, Hopper) that multiply FP8
INT4_GROUP_SIZE = 32  # divides every Llama-2/3 shard up to TP=8 (Llama-2-7B's w2 at TP=8 is 1376 wide)
INT4_GROUP_SIZES = (32, 64, 128)
# The output projection is quantized in int8 in both modes: it costs no perplexity and reads a quarter
# of its fp32 bytes (docs/quantization.md, the output projection). Tied to the embedding, it is an
# int8 copy of it: the embedding stays in full precision for its lookups.
OUTPUT_MODE = {"int8": "int8", "int4": "int8", "fp8": "fp8"}
ROW_PARALLEL = ("attention.wo", "feed_forward.w2")  # their shards hold part of each row
BLOCK_BITS = {"int8": 8, "int4": 4}  # the modes BlockLinear serves on the CPU
FILE_BLOCKS = {"int8": ("Q8_0",), "int4": ("Q4_0", "Q4_1")}  # the GGUF types each keeps as they are


def int8_quantize(w: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in], scales bf16 [out]) with w ≈ q * scales[:, None], q in -127..127.
    The scales are rounded to bf16 before q is computed, so that q fits the scale the kernel
    uses. group: the ranks that hold the other parts of each row (a row-parallel shard): the
    scales then come from the whole rows, as without tensor parallelism."""
    absmax = row_absmax(w, group)
    scales = torch.where(absmax > 0, absmax / 127, 1.0).to(torch.bfloat16)
    q = torch.div(w, scales.float()[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return q, scales


def row_absmax(w: torch.Tensor, group=None) -> torch.Tensor:
    """Each row's largest magnitude (fp32), over the whole rows when group holds their other parts."""
    lo, hi = w.aminmax(dim=1)  # no full-size temporary: the loader's peak is one layer plus q
    absmax = torch.maximum(-lo, hi).float()
    if group is not None:
        dist.all_reduce(absmax, op=dist.ReduceOp.MAX, group=group)
    return absmax


def fp8_quantize(w: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [out, in], scales fp32 [out]) with w ≈ q * scales[:, None]; group as
    in int8_quantize."""
    absmax = row_absmax(w, group)
    scales = torch.where(absmax > 0, absmax / FP8_MAX, 1.0)
    return torch.div(w, scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


def int4_quantize(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int32 [out, in] in 0..15, scales_and_zeros bf16 [in / group_size, out, 2]) with
    w ≈ (q - 8) * scale + zero in each group of group_size input channels (tinygemm's layout:
    the zero is a float, the group's midpoint). Scales and zeros are rounded to bf16 first."""
    out_features, in_features = w.shape
    g = w.view(out_features, in_features // group_size, group_size)
    lo, hi = (t.float() for t in g.aminmax(dim=-1))
    scales = ((hi - lo) / 15).clamp(min=1e-6).to(torch.bfloat16)
    zeros = (lo + 8 * scales.float()).to(torch.bfloat16)
    q = torch.sub(g, zeros.float()[..., None]).div_(scales.float()[..., None]).add_(8).round_().clamp_(0, 15)
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
    return q.to(torch.int32).view(out_features, in_features), scales_and_zeros


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, group=None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scales = int8_quantize(weight, group)
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales if weight.device.type == "cpu" else scales.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features).to(torch.bfloat16),
                                                     self.weight, self.scales)
            return out.view(*x.shape[:-1], self.out_features).to(x.dtype)
        return (F.linear(x, self.weight.to(x.dtype)) * self.scales).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scales.float()[:, None]


class Int4Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size = group_size
        q, scales_and_zeros = int4_quantize(weight, group_size)
        if weight.device.type == "cuda":
            inner_k_tiles = next(t for t in (8, 4, 2) if self.in_features % (t * 16) == 0)
            packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8),
                                                                inner_k_tiles)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.register_buffer("weight", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if x.device.type == "cuda":
            out = torch.ops.aten._weight_int4pack_mm(x2, self.weight, self.group_size, self.scales_and_zeros)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.weight, self.group_size,
                                                             self.scales_and_zeros)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel computes with, read back through the kernel (x = identity)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.weight.device)
        return self.forward(eye).float().t()


class Fp8Linear(nn.Module):
    """FP8 weights; each call quantizes its activations with one scale per token, and
    torch._scaled_mm multiplies the two with their scales into the activations' dtype."""

    def __init__(self, weight: torch.Tensor, group=None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scales = fp8_quantize(weight, group)
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales[None, :])  # (1, out): row-wise scales of the output columns

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        x_scales = x2.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-12) / FP8_MAX
        xq = (x2 / x_scales).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scales, scale_b=self.scales, out_dtype=x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scales.t()


def quantized(linear: nn.Linear, mode: str, group_size: int = INT4_GROUP_SIZE, group=None) -> nn.Module:
    """group: see int8_quantize (int4's groups never straddle two ranks: check() sees to it)."""
    if linear.weight.device.type == "cpu" and mode in BLOCK_BITS:
        return BlockLinear.from_weight(linear.weight, BLOCK_BITS[mode])
    if mode == "int4":
        return Int4Linear(linear.weight, group_size)
    return (Int8Linear if mode == "int8" else Fp8Linear)(linear.weight, group)


def check_device(mode: str, device: torch.device):
    """Refuse a mode that device cannot run, with the reason: fp8 needs a CUDA GPU of compute
    capability 8.9 or newer."""
    if mode != "fp8":
        return
    if device.type != "cuda":
        raise ValueError(f"fp8 quantization needs a CUDA GPU of compute capability {FP8_CAPABILITY[0]}."
                         f"{FP8_CAPABILITY[1]}+ (torch._scaled_mm); this rank runs on {device.type}: use int8 or int4")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        raise ValueError(f"fp8 quantization needs compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}+ "
                         f"(torch._scaled_mm); {torch.cuda.get_device_name(device)} has "
                         f"{capability[0]}.{capability[1]}: use int8 or int4")


def projections(model: nn.Module, mode: str) -> dict[str, str]:
    """{name: int8 or int4} of the linear layers that mode quantizes: every projection in the
    blocks, and the output projection (OUTPUT_MODE). The embedding and the norms stay in
    full precision."""
    chosen = {f"layers.{name}": mode for name, m in model.layers.named_modules() if isinstance(m, nn.Linear)}
    return chosen | {"output": OUTPUT_MODE[mode]}


def check(model: nn.Module, mode: str, group_size: int = INT4_GROUP_SIZE):
    """Refuse, before anything is loaded, what the kernels cannot do: an unknown mode, or int4
    groups that do not divide a shard's input width (the row-parallel wo and w2 of a rank
    hold only their part of the input channels)."""
    if mode not in MODES:
        raise ValueError(f"quantization must be one of none, {', '.join(MODES)}; got {mode!r}")
    if mode != "int4":
        return
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    for name, how in projections(model, mode).items():
        if how != "int4":
            continue
        m = model.get_submodule(name)
        if m.in_features % group_size:
            fits = [g for g in INT4_GROUP_SIZES if m.in_features % g == 0]
            raise ValueError(f"int4 needs each shard's input width to divide by the group size {group_size}: "
                             f"{name} takes {m.in_features} input channels on this rank"
                             + (f" (group sizes that fit: {fits})" if fits else
                                " (no int4 group size fits: use int8, or fewer ranks)"))
        if m.out_features % 16:
            raise ValueError(f"int4 needs output widths divisible by 16: {name} has {m.out_features} on this rank")


@torch.no_grad()
def quantize(model: nn.Module, mode: str, group_size: int = INT4_GROUP_SIZE, fill=None, from_file=None):
    """Replace the projections of model (a model.Transformer, sharded or not) by quantized
    ones, in place, one module at a time. fill(name, module), when given, first allocates and
    loads the parameters of each module that has its own (load_quantized's does): the model
    can then start on the meta device, and at most one projection is ever in full precision.
    from_file(name, mode), when given, may return a projection's quantized layer made from
    the checkpoint's own blocks instead (load_quantized's, on the CPU)."""
    check(model, mode, group_size)
    chosen = projections(model, mode)
    tied = model.output.weight is model.tok_embeddings.weight
    for name in [name for name, _ in model.named_modules()]:  # names: a replaced module must be freed
        module = model.get_submodule(name)
        if name in chosen and from_file and (layer := from_file(name, chosen[name])) is not None:
            model.set_submodule(name, layer)
            continue
        if tied and module is model.output:
            module.weight = model.tok_embeddings.weight  # loaded (fill made it anew): quantized as it is
        elif fill is not None and any(True for _ in module.parameters(recurse=False)):
            fill(name, module)
        if name in chosen:
            parent = model.get_submodule(name.rpartition(".")[0])  # all-reduces row-parallel outputs
            group = parent.process_group if name.endswith(ROW_PARALLEL) else None
            model.set_submodule(name, quantized(module, chosen[name], group_size, group))


def load_quantized(model: nn.Module, reader, plan: dict, device: torch.device, mode: str, progress=None) -> int:
    """Fill model, sharded on the meta device, from a checkpoint reader (checkpoint.py) by plan
    (tp.weight_plan), quantizing each projection as soon as it is read: the peak is the
    quantized model plus one projection in full precision (and the reader's temporaries).
    Returns the bytes read; progress, if given, is called with the bytes read so far."""
    check_device(mode, device)
    read = 0

    def fill(name: str, module: nn.Module):
        nonlocal read
        to_empty(module, device, recurse=False)
        read += reader.load_into(module, {k: plan[f"{name}.{k}"] for k, _ in module.named_parameters(recurse=False)})
        if progress:
            progress(read)

    def from_file(name: str, how: str) -> BlockLinear | None:
        nonlocal read
        pieces = plan.get(f"{name}.weight") or plan["tok_embeddings.weight"]  # a tied output: the embedding's
        layer = file_blocks(reader, pieces, how)
        read += sum(m.qweight.nbytes + m.scales.nbytes for m in [layer] if m is not None)
        return layer

    keeps_blocks = device.type == "cpu" and mode in BLOCK_BITS and hasattr(reader, "blocks")
    quantize(model, mode, fill=fill, from_file=from_file if keeps_blocks else None)
    model.tie_weights()
    return read


def file_blocks(reader, pieces: list, mode: str) -> BlockLinear | None:
    """The BlockLinear of a projection's pieces (tp.weight_plan's, stacked by rows) as a GGUF
    file holds them, when every piece's blocks are of a type that mode keeps (FILE_BLOCKS)
    and its columns fall on blocks; None otherwise (the weight is then read and quantized)."""
    found = [reader.blocks(piece) for piece in pieces]
    if any(b.qtype.name not in FILE_BLOCKS[mode] or b.skip % BLOCK or b.width % BLOCK for b in found):
        return None
    layers = [BlockLinear.from_gguf(b.qtype, np.ascontiguousarray(b.data), b.data.shape[0],
                                    b.data.shape[1] // GGUF_BLOCK_BYTES[b.qtype.name] * BLOCK, (b.skip, b.skip + b.width))
              for b in found]
    return layers[0] if len(layers) == 1 else BlockLinear.cat(layers)
