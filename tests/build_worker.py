"""Builds of our C++ ops in processes of their own, for test_block_quant.py, forked by
tests/torchrun.output_of (its zygote has imported torch: about a second of CPU a process):

    build_worker.py race SOURCE        cpp_ops.build of SOURCE (a race.cpp)
    build_worker.py kernels CFLAGS...  block_quant's kernels built with CFLAGS added (the fp32
                                       kernels), checked against the documented layout in
                                       torch; prints "computed"
"""

import sys

import torch

import block_quant
import cpp_ops


def check_kernels(cflags: list[str]):
    block_quant.CFLAGS += cflags
    block_quant.INT8_X = False  # the fp32 kernels: a build without VNNI has only them
    block_quant.load()
    torch.manual_seed(0)
    for bits in (4, 8):
        layer = block_quant.BlockLinear.from_weight(torch.randn(37, 576), bits)
        blocks = layer.qweight.view(37, 18, -1)
        q = torch.cat([blocks & 15, blocks >> 4], -1) if bits == 4 else blocks  # the layout, in torch
        w = q.float() * layer.scales.float()[..., None] + (0 if bits == 8 else layer.offsets.float()[..., None])
        assert torch.equal(layer.dequantize(), w.view(37, 576)), bits
        assert torch.equal(layer.dequantize(torch.bfloat16), w.view(37, 576).bfloat16()), bits
        x = torch.randn(5, 576)
        out = layer(x).double()
        ref = x.double() @ w.view(37, 576).double().T
        assert ((out - ref).abs() / (x.double().abs() @ w.view(37, 576).double().abs().T)).max() < 1e-6, bits
    print("computed")


if __name__ == "__main__":
    if sys.argv[1] == "race":
        cpp_ops.build(sys.argv[2], "race")
    else:
        check_kernels(sys.argv[2:])
