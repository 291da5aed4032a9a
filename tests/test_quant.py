"""Weight-only quantization (quant.py): the quantize and dequantize math against plain
references, the kernels against a matrix product with the dequantized weights, the loading
path, quality on the demo model's trained weights, TP=2 against TP=1, and a TorchServe with
handler.quantization: int8 against the same model in this process.

Quality is judged on tests/data/devils_dictionary.txt: 15 entries of Ambrose Bierce's The
Devil's Dictionary (1911, public domain; the text of Debian's dict-devil package), one
paragraph each. The demo was trained on Debian's fortunes and fortunes-min (tools/train_demo.py),
which quote Bierce: these entries were chosen to share no run of 6 words with those fortunes,
and grep -rF finds none of their 30-character phrases in /usr/share/games/fortunes."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import generate
import llama2
import quant
from block_quant import BlockLinear
from conftest import DEMO, SERVER_MAX_SEQ_LEN, SERVER_SLOTS, parting, start_demo_server
from torchrun import run

HELD_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "devils_dictionary.txt")
WINDOW = 512  # the demo's training context
N_NEW = 24
PROMPTS = ["The secret of a happy life is", "Once upon a time"]


# --- the math, against plain references --------------------------------------------------

def weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Random weights with an outlier, a row of zeros and a constant group of 32."""
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[1, 3] = 1.5
    w[2] = 0.0
    w[3, :32] = 0.25
    return w


def plain_int8(w: torch.Tensor):
    q, scales = torch.empty(w.shape, dtype=torch.int8), []
    for i, row in enumerate(w.tolist()):
        absmax = max(abs(v) for v in row)
        scale = torch.tensor(absmax / 127 if absmax else 1.0).bfloat16().item()
        scales.append(scale)
        q[i] = torch.tensor([max(-127, min(127, round(v / scale))) for v in row])
    return q, torch.tensor(scales).bfloat16()


def plain_int4_dequantized(w: torch.Tensor, group_size: int) -> torch.Tensor:
    out = torch.empty_like(w)
    for i in range(w.shape[0]):
        for start in range(0, w.shape[1], group_size):
            g = w[i, start:start + group_size]
            scale = torch.tensor(max((g.max() - g.min()).item() / 15, 1e-6)).bfloat16().float()
            zero = (g.min() + 8 * scale).bfloat16().float()  # the group's midpoint
            q = ((g - zero) / scale + 8).round().clamp(0, 15)
            out[i, start:start + group_size] = (q - 8) * scale + zero
    return out


def test_int8_quantize_matches_a_plain_reference():
    w = weight(16, 96)
    q, scales = quant.int8_quantize(w)
    q_ref, scales_ref = plain_int8(w)
    assert q.dtype == torch.int8 and scales.dtype == torch.bfloat16
    assert torch.equal(scales, scales_ref)
    # round-half cases may go either way in the reference's Python round(): allow 1 step there
    assert (q.int() - q_ref.int()).abs().max() <= 1 and (q != q_ref).float().mean() < 0.01
    error = (q.float() * scales.float()[:, None] - w).abs()
    assert (error <= scales.float()[:, None] * 0.5 + 1e-7).all()  # half a step at most
    assert q[2].eq(0).all() and q.abs().max() == 127


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_quantize_matches_a_plain_reference(group_size):
    w = weight(32, 128)
    q, scales_and_zeros = quant.int4_quantize(w, group_size)
    assert q.min() >= 0 and q.max() <= 15
    assert scales_and_zeros.shape == (128 // group_size, 32, 2) and scales_and_zeros.dtype == torch.bfloat16
    scale, zero = (scales_and_zeros[..., i].t().float().repeat_interleave(group_size, dim=1) for i in (0, 1))
    ours = (q.float() - 8) * scale + zero
    torch.testing.assert_close(ours, plain_int4_dequantized(w, group_size), rtol=0, atol=1e-6)
    assert ((ours - w).abs() <= scale * 0.5 + 2e-3 * w.abs().max()).all()  # half a step, bf16 zeros
    assert ours[2].abs().max() < 1e-4  # the zero row stays zero


def test_fp8_quantize_rounds_each_weight_to_e4m3():
    """One scale per row (its largest weight maps to e4m3's 448); each weight is off by at most
    half a step of e4m3's 3-bit mantissa (1/16 of it), or of its smallest subnormal step."""
    w = weight(48, 128)
    q, scales = quant.fp8_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (48,)
    absmax = w.abs().amax(dim=1)
    torch.testing.assert_close(scales, torch.where(absmax > 0, absmax / 448, 1.0))  # a zero row keeps scale 1
    deq = q.float() * scales[:, None]
    assert ((deq - w).abs() <= w.abs() / 16 + scales[:, None] * 2.0 ** -10).all()


@pytest.mark.parametrize("mode", quant.MODES)
def test_linear_layers_compute_with_their_dequantized_weights(mode):
    """Each kernel (CPU: _weight_int8pack_mm, _weight_int4pack_mm_for_cpu, on bf16 activations;
    _scaled_mm for fp8, its activations quantized per token) against F.linear with the
    dequantized weights, for fp32 and bf16 inputs of any leading shape."""
    w = weight(48, 128)
    layer = {"int8": quant.Int8Linear, "int4": lambda w: quant.Int4Linear(w, 32), "fp8": quant.Fp8Linear}[mode](w)
    if mode == "int4":  # dequantize() reads the packed weights back through the kernel
        torch.testing.assert_close(layer.dequantize(), plain_int4_dequantized(w, 32), rtol=1e-2, atol=1e-3)
    deq = layer.dequantize()
    assert (deq - w).abs().max() < {"int8": 0.02, "int4": 0.15, "fp8": 0.25}[mode]
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(1))
    for dtype in (torch.float32, torch.bfloat16):
        out = layer(x.to(dtype))
        assert out.dtype == dtype and out.shape == (2, 3, 48)
        expected = F.linear(x.bfloat16().float(), deq)
        atol = (4e-2 if mode == "fp8" else 2e-2) * expected.abs().max().item()  # fp8: its activations too
        torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=atol)


# --- loading -----------------------------------------------------------------------------

def load_demo(quantization=None, max_seq_len=WINDOW, max_batch_size=1):
    return llama2.tp_llama(None, DEMO, os.path.join(DEMO, "tokenizer.model"), 1, max_batch_size=max_batch_size,
                           max_seq_len=max_seq_len, quantization=quantization)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match=r"quantization must be one of none, int8, int4, fp8; got 'int3'"):
        load_demo("int3")


def test_fp8_is_refused_off_a_gpu_that_multiplies_fp8():
    with pytest.raises(ValueError, match=r"fp8 quantization needs a CUDA GPU of compute capability 8\.9\+ "
                                         r"\(torch._scaled_mm\); this rank runs on cpu: use int8 or int4"):
        load_demo("fp8")


def test_int4_refuses_shards_that_its_groups_do_not_divide():
    """A rank's row-parallel shard of w2 (here 80 input channels) or wo must divide by the
    group size; the error names the layer, its width and the group sizes that would fit."""
    with torch.device("meta"):
        model = llama2.Transformer(llama2.ModelArgs(dim=64, n_layers=1, n_heads=4, intermediate_size=80,
                                                    vocab_size=64))
    with pytest.raises(ValueError, match=r"layers.0.feed_forward.w2 takes 80 input channels .*no int4 group"):
        quant.check(model, "int4")
    quant.check(model, "int8")  # int8 has no groups
    with torch.device("meta"):
        model = llama2.Transformer(llama2.ModelArgs(dim=96, n_layers=1, n_heads=2, intermediate_size=128,
                                                    vocab_size=64))
    fits = r"layers.0.attention.wqkv takes 96 input channels on this rank \(group sizes that fit: \[32\]\)"
    with pytest.raises(ValueError, match=fits):
        quant.check(model, "int4", group_size=64)


@pytest.mark.parametrize("mode", ["int8", "int4"])  # fp8 loads on GPUs only
def test_loading_quantizes_one_projection_at_a_time(monkeypatch, mode):
    """tp_llama(quantization=...) reads and quantizes module by module: whenever a projection
    is quantized, it is the only one in full precision. The result equals quantizing the
    model after a full-precision load; the embedding and the norms stay in full precision."""
    loading, full_precision = [], []
    real_load_quantized, real_quantized = quant.load_quantized, quant.quantized

    def load_quantized(model, *args, **kwargs):
        loading.append(model)
        return real_load_quantized(model, *args, **kwargs)

    def quantized(linear, *args):
        full_precision.append(sum(isinstance(m, nn.Linear) and not m.weight.is_meta for m in loading[0].modules()))
        return real_quantized(linear, *args)

    monkeypatch.setattr(quant, "load_quantized", load_quantized)
    monkeypatch.setattr(quant, "quantized", quantized)
    streamed = load_demo(mode).model
    monkeypatch.undo()
    assert full_precision == [1] * (4 * streamed.n_layers + 1)  # wqkv, wo, w13, w2 per block; output

    full = load_demo().model
    quant.quantize(full, mode)
    assert not any(isinstance(m, nn.Linear) for m in streamed.modules())
    assert streamed.tok_embeddings.weight.dtype == streamed.norm.weight.dtype == torch.float32
    expected = dict(full.state_dict())
    assert streamed.state_dict().keys() == expected.keys()
    for name, t in streamed.state_dict().items():
        assert t.dtype == expected[name].dtype and torch.equal(t, expected[name]), name


# --- quality on the demo's trained weights -----------------------------------------------

@pytest.fixture(scope="module")
def held_out_windows():
    """The held-out text as the demo was trained: BOS entry EOS, packed, in windows of 512."""
    from tokenizer import Tokenizer

    tok = Tokenizer(os.path.join(DEMO, "tokenizer.model"))
    with open(HELD_OUT) as f:
        ids = [i for entry in f.read().split("\n\n") for i in tok.encode(entry.strip(), bos=True, eos=True)]
    assert len(ids) > 2000
    return [torch.tensor([ids[s:s + WINDOW + 1]]) for s in range(0, len(ids) - 1, WINDOW)]


def teacher_forced(model, windows) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, targets) of every position of the windows, each window a fresh prefill."""
    logits = torch.cat([model(w[:, :-1], 0)[0] for w in windows])
    return logits, torch.cat([w[0, 1:] for w in windows])


def perplexity(logits, targets) -> float:
    return math.exp(F.cross_entropy(logits.float(), targets).item())


@pytest.fixture(scope="module")
def unquantized(held_out_windows):
    return teacher_forced(load_demo().runner, held_out_windows)


@pytest.mark.parametrize("mode, limit", [("int8", 0.01), ("int4", 0.10)])
def test_perplexity_on_held_out_text(held_out_windows, unquantized, mode, limit):
    logits, targets = teacher_forced(load_demo(mode).runner, held_out_windows)
    base, ours = perplexity(*unquantized), perplexity(logits, targets)
    print(f"held-out perplexity: unquantized {base:.3f}, {mode} {ours:.3f} ({100 * (ours / base - 1):+.2f}%)")
    assert base < 0.1 * unquantized[0].shape[-1]  # the text is English the model has learnt: far from uniform
    assert ours <= base * (1 + limit)


def test_int8_top1_agreement(held_out_windows, unquantized):
    """Teacher-forced: at each position of the held-out text, int8's most likely next token
    is the unquantized model's at least 98% of the time."""
    logits, _ = teacher_forced(load_demo("int8").runner, held_out_windows)
    agreement = (logits.argmax(-1) == unquantized[0].argmax(-1)).float().mean().item()
    print(f"int8 top-1 agreement: {100 * agreement:.2f}% of {len(logits)} positions")
    assert agreement >= 0.98


def test_quality_checks_can_fail(held_out_windows, unquantized, monkeypatch):
    """The checks above see a damaged quantization: int8 (the CPU's blocks of 32, block_quant)
    with 3 levels per block instead of 255 fails both the perplexity and the agreement limits."""
    real = BlockLinear.from_weight.__func__

    def three_levels(cls, w, bits):
        layer = real(cls, w, bits)
        layer.qweight = (layer.qweight.float() / 127).round().to(torch.int8)
        layer.scales = (layer.scales.float() * 127).half()
        return layer

    monkeypatch.setattr(BlockLinear, "from_weight", classmethod(three_levels))
    logits, targets = teacher_forced(load_demo("int8").runner, held_out_windows)
    assert perplexity(logits, targets) > 1.10 * perplexity(*unquantized)
    assert (logits.argmax(-1) == unquantized[0].argmax(-1)).float().mean().item() < 0.9


# --- tensor parallelism and TorchServe -----------------------------------------------------

def greedy(llama) -> tuple[list, list]:
    tokens = [llama.tokenizer.encode(p, bos=True, eos=False) for p in PROMPTS]
    return generate.generate(llama.runner, tokens, N_NEW, temperature=0, logprobs=True, tokenizer=llama.tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_tp2_gives_the_greedy_tokens_of_tp1(tmp_path, mode):
    """Each rank quantizes its own shard; int8's row-parallel shards (wo, w2) take their
    scales from whole rows (an all-reduce of the row maxima), as at TP=1; int4's groups of
    input channels lie within a shard. The logprobs differ by the bf16 rounding of the
    partial sums (up to 0.03 measured for int8)."""
    llama = load_demo(mode, max_seq_len=128, max_batch_size=len(PROMPTS))
    tokens, logprobs = greedy(llama)
    results = run("quant_worker.py", 2, tmp_path, mode, *PROMPTS)
    for r in results:
        for prompt, ours, want, ours_logprobs, want_logprobs in zip(PROMPTS, r["greedy"], tokens, r["logprobs"],
                                                                     logprobs):
            same = agreed_prefix(llama, prompt, ours, want)
            assert ours_logprobs[:same] == pytest.approx(want_logprobs[:same], abs=NEAR_TIE)


NEAR_TIE = 0.1  # log-probability: tokens this close may trade places when other sums round otherwise


def agreed_prefix(llama, prompt: str, ours: list[int], want: list[int]) -> int:
    """How many greedy tokens ours (another TP size) shares with want (llama's, here): all of
    them, or those before a near tie, where llama's logprob of our token is within NEAR_TIE of
    its own choice's (x in int8 blocks, as the kernels round it below BF16_ROWS rows, can tip
    it: then the texts go their own ways and are not compared past it)."""
    same = parting(ours, want)
    if same is None:
        assert len(ours) == len(want)
        return len(want)
    ids = llama.tokenizer.encode(prompt, bos=True, eos=False) + want[:same]
    logprobs = torch.log_softmax(llama.model(torch.tensor([ids]), 0)[0, -1].float(), -1)
    assert logprobs[want[same]] - logprobs[ours[same]] < NEAR_TIE, (prompt, same, ours[same], want[same])
    return same


@pytest.mark.slow
def test_torchserve_with_int4_answers_as_int4_in_process(tmp_path, demo_llama):
    """handler.quantization: int4 on a TP=2 TorchServe (one server for the setting's way
    through the handler; int8 shares it and is tested at TP=2 above): greedy answers and
    their logprobs are the int4 model's in this process (logprobs within the bf16 rounding
    of TP=2's partial sums), up to a near tie (agreed_prefix)."""
    body = {"prompt": PROMPTS, "temperature": 0, "max_new_tokens": N_NEW, "logprobs": True, "top_logprobs": 5}
    server = start_demo_server(tmp_path, quantization="int4")
    try:
        answers = server.generate(body)
    finally:
        server.stop(wait=False)
    int4_demo_llama = llama2.tp_llama(None, DEMO, os.path.join(DEMO, "tokenizer.model"), 1,
                                      max_batch_size=SERVER_SLOTS, max_seq_len=SERVER_MAX_SEQ_LEN, quantization="int4")
    expected = int4_demo_llama.text_completion(PROMPTS, N_NEW, temperature=0, logprobs=True)
    unquantized = demo_llama.text_completion(PROMPTS, N_NEW, temperature=0, logprobs=True)
    for answer, want in zip(answers, expected):
        # the same tokens, or the same up to a near tie among the server's own top logprobs
        same = parting(answer["tokens"], want["tokens"])
        if same is None:
            assert answer["generation"] == want["generation"] and answer["tokens"] == want["tokens"]
        else:
            top = {t["token"]: t["logprob"] for t in answer["top_logprobs"][same]}
            assert answer["logprobs"][same] - top.get(want["tokens"][same], float("-inf")) < NEAR_TIE
        assert answer["logprobs"][:same] == pytest.approx(want["logprobs"][:same], abs=NEAR_TIE)
    # int4 answers otherwise than the unquantized model here, so a server that did not
    # quantize would fail
    assert [a["generation"] for a in expected] != [u["generation"] for u in unquantized]


def test_handler_refuses_an_unknown_quantization():
    import types

    import handler

    ctx = types.SimpleNamespace(model_yaml_config={"continuousBatching": True, "handler": {"quantization": "int3"}},
                                system_properties={"model_dir": DEMO})
    with pytest.raises(ValueError, match=r"handler.quantization must be none, int8, int4 or fp8, got 'int3'"):
        handler.LlamaHandler().initialize(ctx)
