"""Block-quantized linear layers (block_quant.py, block_quant.cpp): the kernels against a matrix
product with the dequantized weights, GGUF's numbers kept exactly (gguf.quants as reference),
column shards, fused rows, bf16 inputs, torch.compile, and the refusal without a compiler."""

import os
import shutil
import subprocess
import sys

import gguf
import pytest
import torch
import torch.nn.functional as F

import block_quant
import torchrun
from block_quant import BlockLinear
from conftest import DEMO, ROOT, SMOLLM2, TESTS_CXX, gguf_parsed_once

QTYPES = [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0]


def weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random weights with an outlier, a row of zeros, a constant block and a negative block."""
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[0, 3] = 1.5
    if rows > 3:
        w[1] = 0.0
        w[2, :32] = 0.25
        w[3, 32:64] = -torch.rand(32, generator=torch.Generator().manual_seed(seed))
    return w


def kernel(layer: BlockLinear, x: torch.Tensor, bf16: bool = False, int8_x: bool = False) -> torch.Tensor:
    """The kernel in fp32 at any number of rows (bf16: in bf16 from 1 row, where there is AMX;
    int8_x: with x in int8 blocks, where there is VNNI), whatever forward would pick for these rows."""
    bf16_rows = 1 if bf16 else block_quant.KERNEL_MAX_ROWS + 1
    if layer.bits == 4:
        return torch.ops.block_quant.linear_q4(x, layer.qweight, layer.scales, layer.offsets, bf16_rows, int8_x)
    return torch.ops.block_quant.linear_q8(x, layer.qweight, layer.scales, bf16_rows, int8_x)


def cases(bits: int, Ks, Ns, Ms):
    """(layer, x) for each in_features K, out_features N and rows M: weight(N, K) quantized to
    bits, x random (M, K)."""
    for K in Ks:
        for N in Ns:
            layer = BlockLinear.from_weight(weight(N, K, seed=N), bits)
            for M in Ms:
                yield layer, torch.randn(M, K, generator=torch.Generator().manual_seed(M))


def int8_x_products(layer: BlockLinear, x: torch.Tensor) -> torch.Tensor:
    """What int8_x computes, by its definition (block_quant.cpp), in float64: each block of 32 of
    x rounded to int8 with d = max |x| / 127 (to nearest even, of x * (127 / max |x|) in fp32);
    a block's integer dot product with the weight's levels, times the fp32 product of the
    weight's scale and d; plus each block's offset times x's sum over it."""
    (M, K), N = x.shape, layer.out_features
    blocks = x.view(M, K // 32, 32)
    amax = blocks.abs().amax(-1)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = (blocks * inverse[..., None]).round().clamp(-127, 127).double()
    if layer.bits == 4:
        packed = layer.qweight.view(N, K // 32, 16)
        levels = torch.cat([packed & 15, packed >> 4], -1).double()
    else:
        levels = layer.qweight.view(N, K // 32, 32).double()
    scales = (layer.scales.float()[None] * (amax / 127)[:, None]).double()  # (M, N, blocks), rounded in fp32
    out = (scales * torch.einsum("mbk,nbk->mnb", q, levels)).sum(-1)
    if layer.bits == 4:
        out += blocks.double().sum(-1) @ layer.offsets.double().T
    return out


def assert_matches_dequantized(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor | None = None):
    """out == ref (default x @ w.T) up to the order of fp32 sums: each error within 1e-6 of the
    sum of the products' magnitudes, |x| @ |w|.T (quantization errors are ~1e-2 of it, bf16
    rounding ~4e-3)."""
    ref = x.double() @ w.double().T if ref is None else ref
    scale = x.double().abs() @ w.double().abs().T
    err = ((out.double() - ref).abs() / scale.clamp(min=1e-30)).max().item()
    assert err < 1e-6, err


@pytest.mark.slow  # builds and runs the C++ kernels at many shapes
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("K", [64, 576, 1536])
def test_kernels_compute_the_dequantized_weights(bits, K):
    for N in (1, 7, 37, 101):  # tails of every tile width
        layer = BlockLinear.from_weight(weight(N, K, seed=N), bits)
        w = layer.dequantize()
        for M in (1, 2, 3, 8, 17, 64):
            x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
            assert_matches_dequantized(kernel(layer, x), x, w)


@pytest.mark.parametrize("bits", [4, 8])
def test_kernels_with_int8_x_compute_int8_products(bits):
    """int8_x, where there is VNNI: int8_x_products up to the order of the fp32 sums, at every
    tile height (1 to 8 rows of x, then 9), tails of the tile widths, an odd last block (blocks
    go in pairs), K across several 16-block chunks, a block of x all zeros and one of large
    values; and not the fp32 kernel's numbers (x is rounded)."""
    block_quant.load()
    if not torch.ops.block_quant.vnni():
        pytest.skip("int8_x takes AVX512-VNNI")
    for layer, x in cases(bits, (64, 96, 576, 1056), (1, 7, 37), range(1, 10)):
        x[0, :32] = 0
        x[-1, -32:] *= 1e4
        assert_matches_dequantized(kernel(layer, x, int8_x=True), x, layer.dequantize(), int8_x_products(layer, x))
    assert not torch.equal(kernel(layer, x, int8_x=True), kernel(layer, x))


@pytest.mark.parametrize("bits", [4, 8])
def test_kernels_in_bf16_compute_the_dequantized_weights_in_bf16(bits):
    """From bf16_rows rows, on AMX: x @ w.T with x and w rounded to bf16, summed in fp32 (up to
    the order of the sums), at every row count up to 16, tails of the 16-row tiles, an odd last
    block (q4 pairs blocks), and K across several 16-block chunks; past 16 rows, in fp32."""
    block_quant.load()
    if not torch.ops.block_quant.amx():
        pytest.skip("computing in bf16 takes AMX (a CPU with amx_bf16, and the OS's leave)")
    for layer, x in cases(bits, (64, 96, 288, 1056), (1, 17, 40), (1, 2, 7, 16)):
        w = layer.dequantize(torch.bfloat16).float()
        assert_matches_dequantized(kernel(layer, x, bf16=True), x.bfloat16().float(), w)
    x = torch.randn(17, layer.in_features)
    assert torch.equal(kernel(layer, x, bf16=True), kernel(layer, x))


@pytest.mark.slow  # builds and runs the C++ kernels
def test_kernels_on_two_threads_compute_the_same():
    """Tasks split the output rows, never a sum: the result does not depend on the threads."""
    layer = BlockLinear.from_weight(weight(101, 576), 4)
    x = torch.randn(5, 576)
    for bf16, int8_x in ((False, False), (False, True), (True, False)):
        one = kernel(layer, x, bf16, int8_x)
        saved = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            two = kernel(layer, x, bf16, int8_x)
        finally:
            torch.set_num_threads(saved)
        assert torch.equal(one, two), (bf16, int8_x)


@pytest.mark.parametrize("bits", [4, 8])
def test_from_weight_rounds_to_the_nearest_level(bits):
    """4 bits: Q4_1's levels min + scale * q; 8 bits: Q8_0's scale * q, scale = absmax / 127.
    Every weight lands within half a level of its own value (plus the fp16 rounding of min)."""
    w = weight(9, 128)
    layer = BlockLinear.from_weight(w, bits)
    blocks = w.view(9, 4, 32)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    scale = (hi - lo) / 15 if bits == 4 else torch.maximum(-lo, hi) / 127
    assert torch.equal(layer.scales, scale.half())
    if bits == 4:
        assert torch.equal(layer.offsets, lo.half())
    err = (layer.dequantize().view(9, 4, 32) - blocks).abs()
    fp16_offset = (lo - lo.half().float()).abs() if bits == 4 else 0
    assert (err <= (layer.scales.float() / 2 * 1.001 + fp16_offset)[..., None] + 1e-7).all()


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_gguf_blocks_are_kept_exactly(qtype):
    """Blocks written by gguf.quants.quantize dequantize to gguf.quants.dequantize's numbers, bit
    for bit but for the sign of Q4_0's zeros (d * (8 - 8) is -0.0 for a negative d, our
    fma(8, d, -8 * d) +0.0), and the kernel computes with them."""
    rows, cols = 37, 576
    raw = gguf.quants.quantize(weight(rows, cols).numpy(), qtype)
    layer = BlockLinear.from_gguf(qtype, raw, rows, cols)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    assert torch.equal(layer.dequantize(), expected)
    zeros = expected == 0
    assert torch.equal(layer.dequantize()[~zeros].view(torch.int32), expected[~zeros].view(torch.int32))
    x = torch.randn(3, cols)
    assert_matches_dequantized(kernel(layer, x), x, expected)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_gguf_row_slices_and_column_ranges(qtype):
    """A slice of the rows (raw[a:b]) and a range of input channels (a TP shard) hold exactly those
    weights; a range that cuts a block is refused."""
    rows, cols = 12, 256
    raw = gguf.quants.quantize(weight(rows, cols).numpy(), qtype)
    full = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    part = BlockLinear.from_gguf(qtype.name, raw[4:9], 5, cols, columns=(64, 192))
    assert (part.out_features, part.in_features) == (5, 128)
    assert torch.equal(part.dequantize(), full[4:9, 64:192])
    with pytest.raises(ValueError, match="multiples of 32"):
        BlockLinear.from_gguf(qtype, raw, rows, cols, columns=(16, 128))
    with pytest.raises(ValueError, match="uint8"):
        BlockLinear.from_gguf(qtype, raw, rows + 1, cols)


@pytest.mark.slow  # builds and runs the C++ kernels at many shapes
def test_smollm2_tensors_from_the_file():
    """The file's own Q4_1 projection and Q8_0 embedding, as gguf.GGUFReader gives them."""
    if not os.path.exists(SMOLLM2):
        pytest.skip(f"{SMOLLM2} is missing: make smollm2")
    with gguf_parsed_once():
        tensors = {t.name: t for t in gguf.GGUFReader(SMOLLM2).tensors}
    for name, rows in (("blk.0.ffn_down.weight", slice(None)), ("token_embd.weight", slice(1000, 1100))):
        t = tensors[name]
        raw = t.data[rows]
        cols = int(t.shape[0])
        layer = BlockLinear.from_gguf(t.tensor_type, raw, raw.shape[0], cols)
        assert torch.equal(layer.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, t.tensor_type)))


def test_cat_fuses_rows():
    """A fused projection from pieces (q4 of both GGUF kinds): its weight and its outputs are the pieces' in turn."""
    cols = 192
    pieces = [BlockLinear.from_weight(weight(16, cols, 1), 4),
              BlockLinear.from_gguf("Q4_0", gguf.quants.quantize(weight(5, cols, 2).numpy(), QTYPES[0]), 5, cols)]
    fused = BlockLinear.cat(pieces)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in pieces]))
    x = torch.randn(2, cols)
    assert torch.equal(fused(x), torch.cat([p(x) for p in pieces], -1))
    with pytest.raises(ValueError, match="one bit width"):
        BlockLinear.cat([pieces[0], BlockLinear.from_weight(weight(4, cols), 8)])


def test_long_inputs_are_multiplied_in_bf16_only_where_the_cpu_has_its_instructions():
    """oneDNN emulates bf16 products without AVX512-BF16 (6x slower than fp32 on an AVX2 EPYC)."""
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    assert block_quant.LINEAR_DTYPE == (torch.bfloat16 if "avx512_bf16" in flags else torch.float32)


@pytest.mark.parametrize("int8_x", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_forward_shapes_dtypes_and_the_bf16_path(bits, int8_x, monkeypatch):
    """forward: any leading shape, float32 or bfloat16 (computed by the kernels below BF16_ROWS
    rows, with x in int8 blocks as INT8_X says, in bf16 from there up to KERNEL_MAX_ROWS where
    there is AMX, by F.linear above in LINEAR_DTYPE (each tried), on slices of 16 rows here),
    output in x's dtype."""
    monkeypatch.setattr(block_quant, "DEQUANTIZE_SLICE", 16 * 256)
    monkeypatch.setattr(block_quant, "INT8_X", int8_x)
    layer = BlockLinear.from_weight(weight(40, 256), bits)
    w = layer.dequantize()
    first = block_quant.BF16_ROWS[bits]
    for rows in (first - 2, first, block_quant.KERNEL_MAX_ROWS):
        few = torch.randn(1, rows, 256)
        bf16 = torch.ops.block_quant.amx() and rows >= first
        out = layer(few)
        assert out.shape == (1, rows, 40) and out.dtype == torch.float32
        assert torch.equal(out, kernel(layer, few.view(-1, 256), bf16, int8_x and rows < first).view(out.shape))
        out = layer(few.bfloat16())
        assert out.dtype == torch.bfloat16
        want = kernel(layer, few.bfloat16().float().view(-1, 256), bf16, int8_x and rows < first)
        assert torch.equal(out, want.view(out.shape).bfloat16())
    many = torch.randn(block_quant.KERNEL_MAX_ROWS + 1, 256)
    for dtype in (torch.bfloat16, torch.float32):
        monkeypatch.setattr(block_quant, "LINEAR_DTYPE", dtype)
        for x in (many, many.bfloat16()):
            out = layer(x)
            assert out.dtype == x.dtype
            want = F.linear(x.to(dtype), w.to(dtype)).to(x.dtype)
            if dtype == torch.bfloat16:
                assert torch.equal(out, want)
            else:  # a slice of the weight's rows can take another fp32 kernel, whose sums end otherwise
                tolerance = 2**-7 if x.dtype == torch.bfloat16 else 1e-5  # a bf16 rounding tipped, or fp32's
                torch.testing.assert_close(out, want, rtol=tolerance, atol=tolerance)
    assert torch.equal(layer.dequantize(torch.bfloat16), w.bfloat16())
    assert layer(torch.randn(0, 256)).shape == (0, 40)  # an empty batch


def test_fake_implementations():
    """torch.library.opcheck: the ops' schemas and their fake (meta) implementations agree with the kernels."""
    layer = BlockLinear.from_weight(weight(8, 64), 4)
    layer8 = BlockLinear.from_weight(weight(8, 64), 8)
    x = torch.randn(3, 64)
    ops = torch.ops.block_quant
    checks = ("test_schema", "test_faketensor")
    for op, args in ((ops.linear_q4, (x, layer.qweight, layer.scales, layer.offsets, 1, False)),
                     (ops.linear_q4, (x, layer.qweight, layer.scales, layer.offsets, 17, True)),
                     (ops.linear_q8, (x, layer8.qweight, layer8.scales, 17, False)),
                     (ops.linear_q8, (x, layer8.qweight, layer8.scales, 17, True)),
                     (ops.dequantize_q4, (layer.qweight, layer.scales, layer.offsets, torch.bfloat16)),
                     (ops.dequantize_q8, (layer8.qweight, layer8.scales, torch.float32))):
        torch.library.opcheck(op, args, test_utils=checks)


@pytest.mark.slow
@pytest.mark.parametrize("int8_x", [False, True])
def test_compiled_module_matches_eager(int8_x, monkeypatch):
    """A module holding BlockLinears compiles with fullgraph=True (no graph break) and computes as
    eagerly, x in fp32 or in int8 blocks; once compiled for a dynamic number of rows, fp32 and bf16
    rows alike run the same graph (the kernels choose, not a branch that would guard on the rows
    and compile again)."""
    monkeypatch.setattr(block_quant, "INT8_X", int8_x)
    torch._dynamo.reset()
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = BlockLinear.from_weight(weight(96, 64), 4)
            self.down = BlockLinear.from_weight(weight(64, 96), 8)

        def forward(self, x):
            return self.down(F.silu(self.up(x)))

    module = Block()
    compiled = torch.compile(module, fullgraph=True)
    for rows in (1, 3, max(block_quant.BF16_ROWS.values()) + 2, block_quant.KERNEL_MAX_ROWS + 4):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(compiled(x), module(x), rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    compiled(torch.randn(2, 64))
    with torch.compiler.set_stance("fail_on_recompile"):
        for rows in (*block_quant.BF16_ROWS.values(), block_quant.BF16_ROWS[4] - 1, block_quant.KERNEL_MAX_ROWS):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(compiled(x), module(x), rtol=1e-6, atol=1e-6)


def test_a_missing_compiler_is_named(monkeypatch):
    """Without a C++ compiler (or ninja), load() refuses with one line that says what is missing,
    before torch's build fails deep inside."""
    monkeypatch.setattr(block_quant, "_loaded", False)
    monkeypatch.setenv("CXX", "no-such-c++")
    with pytest.raises(ValueError) as refusal:
        block_quant.load()
    message = str(refusal.value)
    assert "C++ compiler" in message and "'no-such-c++'" in message and "\n" not in message
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(torch.utils.cpp_extension, "is_ninja_available", lambda: False)
    with pytest.raises(ValueError, match="ninja"):
        block_quant.load()


# --- building: other instruction sets, several processes at once (each compiles: slow) -----

def in_processes(env: dict, n: int, *args: str) -> str:
    """tests/build_worker.py with args in n processes at once (each with env): their output."""
    return torchrun.output_of(os.path.join(ROOT, "tests", "build_worker.py"), *args, env=env, nproc=n)


@pytest.mark.slow
def test_plain_cpp_path():
    """The kernels built without AVX (plain C++) compute the same weights, read back in torch
    from the documented layout (the AVX2 path: test_ranks_building_at_once)."""
    assert "computed" in in_processes(dict(os.environ), 1, "kernels", "-mno-avx")


@pytest.mark.slow
def test_ranks_building_at_once(tmp_path):
    """Two processes (tensor-parallel ranks) loading the kernels at once, with nothing built yet:
    one builds under torch's lock file while the other waits, and both compute. They build the
    kernels without AVX-512 (the AVX2 path), which both check as test_plain_cpp_path does."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert in_processes(env, 2, "kernels", "-mno-avx512f").count("computed") == 2
    assert compiles(tmp_path, "block_quant") == [1]  # compiled once (the source copy: cpp_ops.source_copy)


def build_race(source: str, env: dict):
    """cpp_ops.build of source (a race.cpp) in a process of its own with env."""
    in_processes(env, 1, "race", source)


def compiles(extensions, name: str) -> list[int]:
    """How many times ninja compiled each build of name in the extensions folder."""
    return [log.read_text().count(".o\t") for log in extensions.glob(f"{name}_*/.ninja_log")]


@pytest.mark.slow
def test_the_same_source_from_another_folder_is_not_compiled_again(tmp_path):
    """A process that builds race.cpp from another folder (another checkout, the folder
    TorchServe unpacks a model archive into), then one from the first folder again, load the
    library the first process built: ninja compiles once."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    unpacked = tmp_path / "unpacked"
    unpacked.mkdir()
    source = os.path.join(ROOT, "race.cpp")
    shutil.copy(source, unpacked)
    for path in (source, str(unpacked / "race.cpp"), source):
        build_race(path, env)
    assert compiles(tmp_path / "ext", "race") == [1]


def ninjas() -> dict[str, str]:
    """{version: folder} of the ninjas this machine has: the venv's (requirements.txt) and the
    ones on PATH or in /usr/bin."""
    found = {}
    for folder in [os.path.dirname(sys.executable), *os.environ["PATH"].split(os.pathsep), "/usr/bin"]:
        path = shutil.which("ninja", path=folder)
        if path:
            version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.strip()
            found.setdefault(version, folder)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("other", ["ninja", "compiler"])
def test_builds_by_another_ninja_or_compiler_are_kept_apart(tmp_path, other):
    """A process whose PATH finds another ninja (the system's, outside make), or whose CXX is
    another compiler (the tests' tests/g++-O1, make serve's g++), builds race.cpp in a folder of
    its own: turns between the two compile once each, where sharing one folder they compiled at
    every turn (each reads the other's log as out of date)."""
    if other == "ninja":
        found = ninjas()
        if len(found) < 2:
            pytest.skip(f"one ninja here ({list(found)}): the venv's and another are needed")
        envs = [{"PATH": folder + os.pathsep + os.environ["PATH"]} for folder in list(found.values())[:2]]
    else:
        envs = [{"CXX": "g++"}, {"CXX": TESTS_CXX}]
    source = os.path.join(ROOT, "race.cpp")
    for env in envs + envs[:1]:
        build_race(source, dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), **env))
    assert sum(compiles(tmp_path, "race")) == 2, compiles(tmp_path, "race")


def test_a_worker_rounds_x_as_its_setting_says(monkeypatch):
    """handler.int8_activations reaches the kernels of a worker loaded by loading.load: off (the
    default), a row of x is multiplied in fp32; on, in int8 blocks where the CPU has VNNI."""
    import loading
    from serving_config import ServingConfig

    monkeypatch.setattr(block_quant, "INT8_X", block_quant.INT8_X)  # restored after the test
    outs = []
    for on in (False, True):
        config = ServingConfig(checkpoint=DEMO, quantization="int4", int8_activations=on, max_seq_len=64)
        engine, _ = loading.load(config, "", 1, 1, lambda *args, **kwargs: None)
        layer = next(m for m in engine.runner.model.modules() if isinstance(m, BlockLinear))
        x = torch.randn(1, layer.in_features, generator=torch.Generator().manual_seed(1))
        outs.append(layer(x))
        assert torch.equal(outs[-1], kernel(layer, x, int8_x=on))
    assert torch.equal(outs[0], outs[1]) != torch.ops.block_quant.vnni()
