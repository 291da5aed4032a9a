"""The Python parts of bench/gpu_check.sh, one per call so that each gets its own timeout:

    python bench/gpu_check.py parity [--cpu-dry-run]
    python bench/gpu_check.py graphs [--cpu-dry-run]
    python bench/gpu_check.py speed [--quant none|int8|int4] [--modes eager compiled graphs] [--cpu-dry-run]
    python bench/gpu_check.py serve [--cpu-dry-run]
    python bench/gpu_check.py attention [--cpu-dry-run]

parity  a small random GQA Llama (tools/make_checkpoint.py) loaded by llama2.tp_llama on the GPU,
        in fp32, bf16, and bf16 with int8, int4 and fp8 weights (quant.py's CUDA kernels; fp8
        where the GPU multiplies it, compute capability 8.9+), against
        transformers' LlamaForCausalLM in fp32 on the CPU (the reference of the tests; for int8
        and int4, with its weights quantized and dequantized by the same math): the logits of one
        forward pass, of prefill + chunk + single-token steps, and of rows at different positions
        (tests/tp_worker.py's run_model).
graphs  the same model, bf16 and int8, after compile_decode(cuda_graphs=True): decode steps with
        rows joining and leaving (tests/test_decode_graphs.py's) give the eager logits, and
        inductor skipped no CUDA graph.
speed   decode tokens/s of a random bf16 model of Llama-2-7B's shapes with 8 of its 32 layers
        (a quarter of its bytes per step), made on the GPU (no checkpoint file), its weights
        quantized by --quant, at batch 1 and 8 (prompt 32, 64 new tokens, greedy), through
        generate.generate and as raw decode steps, against the HBM roofline (bytes of weights
        per step / 4.8 TB/s): eager, after compile_decode(), and after
        compile_decode(cuda_graphs=True) (--modes picks), each compile timed.
attention  the speed part's model (its bf16 weights) at batch 1 and 8 with contexts of 4k and
        16k tokens: one decode step with each attention backend (runner.ATTENTION: flex reads
        the paged cache in place, sdpa gathers it), and their logits' agreement.
serve   TorchServe on the GPU with TP=1 (tools/local_server.py, deviceType gpu) serving a small
        checkpoint; one greedy request must equal the same model run in this process.

--cpu-dry-run runs each part on the CPU with small shapes (and fp32 where the GPU runs bf16: inductor
compiles bf16 slowly on a CPU), to check the script itself.
Every part prints PASS, FAIL or SKIP on its last line and exits 0, 1 or 0.
"""

import argparse
import copy
import os
import signal
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ROOT's modules first: bench/structured.py would shadow structured.py
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools"), os.path.join(ROOT, "tests"), os.path.join(ROOT, "bench")]
import generate  # noqa: E402
import llama2  # noqa: E402
import quant  # noqa: E402
from engine import Engine  # noqa: E402
from runner import ModelRunner  # noqa: E402
from sequence import SamplingParams  # noqa: E402
from tp_decode import generate_tokens_per_s, step_bytes, step_ms, sync  # noqa: E402

TOKENIZER = os.path.join(ROOT, "demo", "tokenizer.model")
HBM_BYTES_PER_S = 4.8e12  # H200 datasheet
# Tolerances, as max |logits - reference| / std(reference logits). fp32: summation order only
# (TF32 is off). bf16: 8-bit mantissas for weights and activations through 4 layers; on the CPU
# (oneDNN, --cpu-dry-run) this model's bf16 logits are off by up to 5% of their spread, and a
# wrong head layout or rotation would put them off by about 100%.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.15}
# fp8 quantizes the activations as well (per token, e4m3: about 2% of a layer's output each,
# tests/test_quant.py): a looser bound, still far below a wrong layout's 100%.
FP8_TOLERANCE = 0.3


def device_for(dry: bool) -> torch.device:
    if dry:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        sys.exit("FAIL: no CUDA device (use --cpu-dry-run on a machine without one)")
    return torch.device("cuda")


def small_checkpoint(out: str):
    """A random GQA Llama in Meta's layout (dim 256, 4 layers, 8 heads, 4 KV heads) and its
    reference model."""
    import make_checkpoint
    from tokenizer import Tokenizer

    hf = make_checkpoint.random_hf_model(256, 4, 8, 4, Tokenizer(TOKENIZER).n_words, seed=0)
    return hf, make_checkpoint.write_layouts(hf, out, TOKENIZER, ["meta:1"])["meta:1"]


# --- parity -----------------------------------------------------------------------------

def fake_quantized(hf, mode: str):
    """A copy of the reference model whose linear weights went through quant.py's
    quantization and back (the output projection as quant.OUTPUT_MODE says), from their
    bf16 values, as a bf16 model quantizes them."""
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, m in ref.named_modules():
            if isinstance(m, torch.nn.Linear):
                how = quant.OUTPUT_MODE[mode] if name == "lm_head" else mode
                w = m.weight.bfloat16()
                if how in ("int8", "fp8"):
                    q, scales = (quant.int8_quantize if how == "int8" else quant.fp8_quantize)(w)
                    m.weight.copy_(q.float() * scales.float()[:, None])
                else:
                    q, sz = quant.int4_quantize(w, quant.INT4_GROUP_SIZE)
                    scale, zero = (sz[..., i].t().float().repeat_interleave(quant.INT4_GROUP_SIZE, 1) for i in (0, 1))
                    m.weight.copy_((q.float() - 8) * scale + zero)
    return ref


def parity(dry: bool) -> bool:
    from tp_worker import expected_rows, fixed_tokens, run_model

    device = device_for(dry)
    torch.backends.cuda.matmul.allow_tf32 = False
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        hf, folder = small_checkpoint(tmp)
        tokens = fixed_tokens(hf.config.vocab_size)
        runs = [(dtype, None) for dtype in TOLERANCE] + [(torch.bfloat16, mode) for mode in quant.MODES]
        for dtype, mode in runs:
            # the dry run quantizes fp8 after loading, which refuses it off a GPU that multiplies FP8
            late_fp8 = mode == "fp8" and not fp8_here(device)
            if late_fp8 and not dry:
                continue
            tol = FP8_TOLERANCE if mode == "fp8" else TOLERANCE[dtype]
            with torch.no_grad():
                ref = (fake_quantized(hf, mode) if mode else hf)(tokens).logits.float()
            scale = ref.std().item()
            model = llama2.tp_llama(None, folder, TOKENIZER, 1, dtype=dtype, max_batch_size=4, max_seq_len=64,
                                    quantization=None if late_fp8 else mode).runner
            if late_fp8:
                quant.quantize(model.model, "fp8")
                print("fp8: the dry run quantizes after loading")
            assert model.device.type == device.type, model.device
            out = {k: v.float().cpu() for k, v in run_model(model, tokens.to(device)).items()}
            expected = {"full": ref, "decode": ref, "rows": expected_rows(ref, out["rows"])}
            label = str(dtype)[6:] + (f" {mode}" if mode else "")
            for key, exp in expected.items():
                got, valid = out[key], ~exp[..., 0].isnan()
                err = (got - exp).abs()[valid].max().item() / scale
                # the top token must agree wherever the reference's lead over the second is
                # more than twice the tolerance (bf16 noise can flip nearer ties)
                top2 = exp[valid].topk(2, dim=-1).values
                clear = (top2[:, 0] - top2[:, 1]) > 2 * tol * scale
                agree = got[valid].argmax(-1) == exp[valid].argmax(-1)
                good = err <= tol and bool(agree[clear].all())
                ok &= good
                print(f"{device.type} {label:13} {key:6}: max |Δ| / std = {err:.2e} (tolerance {tol:g}); "
                      f"top token agrees at {int(agree.sum())}/{len(agree)} positions, at "
                      f"{int(agree[clear].sum())}/{int(clear.sum())} with a clear lead  {'ok' if good else 'FAIL'}")
            del model
    return ok


def fp8_here(device: torch.device) -> bool:
    """Whether device runs quant.py's fp8 as served (else says why)."""
    try:
        quant.check_device("fp8", device)
        return True
    except ValueError as e:
        print(f"fp8 as served is refused here: {e}")
        return False


# --- graphs -----------------------------------------------------------------------------

def graphs(dry: bool) -> bool:
    from test_decode_graphs import MAX_BATCH, MAX_SEQ_LEN, decode

    device = device_for(dry)
    dtype = torch.float32 if dry else torch.bfloat16  # inductor compiles bf16 slowly on CPU
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        _, folder = small_checkpoint(tmp)
        for mode in (None, "int8"):
            model = llama2.tp_llama(None, folder, TOKENIZER, 1, dtype=dtype, max_batch_size=MAX_BATCH,
                                    max_seq_len=MAX_SEQ_LEN, quantization=mode).runner
            assert model.device.type == device.type
            eager = decode(model)
            torch._dynamo.utils.counters.clear()
            start = time.perf_counter()
            model.compile_decode(cuda_graphs=True)
            seconds = time.perf_counter() - start
            replayed = decode(model)
            skips = dict(torch._dynamo.utils.counters["inductor"]).get("cudagraph_skips", 0)
            scale = torch.cat([e.float() for e in eager]).std().item()
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip(eager, replayed)) / scale
            tol = TOLERANCE[torch.bfloat16]
            good = err <= tol and (dry or skips == 0)
            ok &= good
            print(f"{device.type} {str(dtype)[6:]}{' ' + mode if mode else ''}: compile_decode(cuda_graphs=True) "
                  f"{seconds:.0f} s, "
                  f"buckets {model.decode_buckets}; {len(eager)} steps, max |Δ| / std from eager = {err:.2e} "
                  f"(tolerance {tol:g}); CUDA graphs skipped by inductor: {skips}  {'ok' if good else 'FAIL'}")
            del model
    return ok


# --- speed ------------------------------------------------------------------------------

class NullTokenizer:
    """generate.generate needs a tokenizer: no EOS (exactly 64 new tokens), nothing to decode."""
    eos_id = -1
    stop_ids = frozenset()

    @staticmethod
    def decode(tokens):
        return ""


def random_model(args: llama2.ModelArgs, device, dtype) -> ModelRunner:
    """Random weights made where they run: allocated on the device, then filled; with its KV cache."""
    with torch.device("meta"):
        model = llama2.Transformer(args)
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=gen)
    model.eval().requires_grad_(False)
    return ModelRunner(model, args.max_batch_size, args.max_seq_len)


def copy_bandwidth(device) -> float:
    """GB/s of a 2 GiB (dry run: 256 MiB) copy on the device, counting bytes read and written."""
    src = torch.ones(2**29 if device.type == "cuda" else 2**26, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(6):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        if i:
            times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def speed_model_args(dry: bool, max_seq_len: int) -> llama2.ModelArgs:
    if dry:
        return llama2.ModelArgs(dim=256, n_layers=2, n_heads=8, vocab_size=2048, max_batch_size=8,
                                max_seq_len=max_seq_len)
    # Llama-2-7B's shapes, 8 of its 32 layers: 1.9B parameters, 3.8 GB in bf16
    return llama2.ModelArgs(dim=4096, n_layers=8, n_heads=32, vocab_size=32000, multiple_of=256, max_batch_size=8,
                            max_seq_len=max_seq_len)


def speed(dry: bool, quantization: str, modes: list[str]) -> bool | None:
    device = device_for(dry)
    reps, steps = (1, 8) if dry else (3, 64)  # the dry run checks the script, not the speed
    args = speed_model_args(dry, 128)
    if quantization == "fp8" and not fp8_here(device):
        print("SKIP: fp8 needs a GPU of compute capability 8.9+")
        return None
    runner = random_model(args, device, torch.float32 if dry else torch.bfloat16)
    if quantization != "none":
        start = time.perf_counter()
        quant.quantize(runner.model, quantization)
        print(f"quantized to {quantization} in {time.perf_counter() - start:.1f} s")
    weight_bytes = step_bytes(runner.model)
    print(f"{device}: {quantization}, {weight_bytes / 1e9:.2f} GB of weights per step; "
          f"device copy {copy_bandwidth(device):.0f} GB/s")
    for mode in modes:
        if mode != "eager":
            start = time.perf_counter()
            runner.compile_decode(cuda_graphs=mode == "graphs")  # compiles (and captures) before it returns
            print(f"compile_decode({'cuda_graphs=True' if mode == 'graphs' else ''}): "
                  f"{time.perf_counter() - start:.0f} s")
        for batch in (1, 8):
            tps = generate_tokens_per_s(runner, NullTokenizer, batch, reps)
            step = step_ms(runner, batch, steps=steps)
            roof = batch * HBM_BYTES_PER_S / weight_bytes
            print(f"{quantization} {mode} batch {batch}: generate {tps:,.0f} tokens/s, decode step {step:.2f} ms "
                  f"({batch * 1e3 / step:,.0f} tokens/s); roofline {roof:,.0f} tokens/s: generate at "
                  f"{100 * tps / roof:.0f}%, step at {100 * batch * 1e3 / step / roof:.0f}%")
            served = {a: engine_tokens_per_s(runner, batch, steps, reps, a) for a in (False, True)}
            print(f"{quantization} {mode} batch {batch}: Engine.run(16) {served[False]:,.0f} tokens/s, with "
                  f"async scheduling {served[True]:,.0f} ({served[True] / served[False]:.2f}x); 1 / step at "
                  f"{100 * served[False] * step / batch / 1e3:.0f}% and {100 * served[True] * step / batch / 1e3:.0f}%")
    return True


def engine_tokens_per_s(runner: ModelRunner, batch: int, new: int, reps: int, async_scheduling: bool) -> float:
    """Tokens per second of the serving engine decoding batch requests of new greedy tokens
    in runs of 16 steps (a TorchServe iteration's), with or without asynchronous scheduling."""
    best = 0.0
    for _ in range(reps):
        engine = Engine(runner, NullTokenizer, max_seqs=batch, async_scheduling=async_scheduling)
        for i in range(batch):
            engine.add([1 + i, 2, 3, 4], SamplingParams(max_gen_len=new, temperature=0))
        sync(runner.device)
        start = time.perf_counter()
        while engine.running:
            engine.run(16)
        sync(runner.device)
        best = max(best, batch * new / (time.perf_counter() - start))
    return best


# --- attention --------------------------------------------------------------------------

def attention(dry: bool) -> bool:
    device = device_for(dry)
    dtype = torch.float32 if dry else torch.bfloat16
    contexts = (256, 1024) if dry else (4096, 16384)
    runner = random_model(speed_model_args(dry, contexts[-1]), device, dtype)
    tol, ok = TOLERANCE[dtype], True
    for context in contexts:
        for rows in (1, 8):  # each row at the end of a context-long sequence (the cache holds junk)
            tokens = torch.randint(3, runner.vocab_size, (rows, 1), device=device)
            logits, ms = {}, {}
            for backend in ("sdpa", "flex"):
                runner.attention = backend
                logits[backend] = runner(tokens, context - 1).float()  # flex: compiled here
                times = []
                for _ in range(3 if dry else 20):
                    sync(device)
                    start = time.perf_counter()
                    runner(tokens, context - 1)
                    sync(device)
                    times.append(time.perf_counter() - start)
                ms[backend] = statistics.median(times) * 1e3
            err = (logits["flex"] - logits["sdpa"]).abs().max().item() / logits["sdpa"].std().item()
            good = err <= tol
            ok &= good
            print(f"{device.type} {str(dtype)[6:]} batch {rows}, context {context:,}: "
                  f"decode step sdpa {ms['sdpa']:.2f} ms, flex {ms['flex']:.2f} ms "
                  f"(flex {ms['sdpa'] / ms['flex']:.2f}x); max |Δ| / std = {err:.1e} (tolerance {tol:g})  "
                  f"{'ok' if good else 'FAIL'}")
    return ok


# --- serve ------------------------------------------------------------------------------

def serve(dry: bool) -> bool | None:
    import shutil

    device = device_for(dry)
    bin_dir = os.path.dirname(sys.executable)
    missing = [name for name in ("torchserve", "torch-model-archiver") if not os.path.exists(os.path.join(bin_dir, name))]
    if missing or not shutil.which("java"):
        print(f"SKIP: TorchServe needs {', '.join(missing) or 'nothing more'} beside {sys.executable}"
              f"{'' if shutil.which('java') else ' and Java 17 on the PATH'}")
        return None
    from local_server import start_server

    prompt, body = "Once upon a time", {"temperature": 0, "max_new_tokens": 16}
    with tempfile.TemporaryDirectory() as tmp:
        _, folder = small_checkpoint(os.path.join(tmp, "ckpt"))
        llama = llama2.tp_llama(None, folder, TOKENIZER, 1, max_batch_size=4, max_seq_len=256)
        expected = generate.text_completion(llama.runner, llama.tokenizer, [prompt], 16, temperature=0)[0]
        del llama
        os.makedirs(os.path.join(tmp, "ts"))
        start = time.perf_counter()
        server = start_server(os.path.join(tmp, "ts"), folder, tp=1, batch_size=4, handler={"max_seq_len": 256},
                              model_config={"deviceType": device.type.replace("cuda", "gpu")})
        try:
            print(f"TorchServe ready in {time.perf_counter() - start:.0f} s ({server.config['deviceType']}, TP=1)")
            answer = server.generate({"prompt": prompt} | body)
            print(f"answer: {answer}")
            if device.type == "cuda":
                free, total = torch.cuda.mem_get_info()
                print(f"GPU memory in use: {total - free:,} bytes "
                      f"(the worker's weights and cache among them)")
            return answer == expected
        finally:
            server.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["parity", "graphs", "speed", "serve", "attention"])
    ap.add_argument("--quant", choices=["none", *quant.MODES], default="none", help="speed: the weights' quantization")
    ap.add_argument("--modes", nargs="+", choices=["eager", "compiled", "graphs"], default=["eager", "compiled", "graphs"],
                    help="speed: eager, after compile_decode(), after compile_decode(cuda_graphs=True)")
    ap.add_argument("--cpu-dry-run", action="store_true")
    a = ap.parse_args()
    dry = a.cpu_dry_run
    # gpu_check.sh's timeout sends SIGTERM: unwind, so that serve's finally stops TorchServe
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("FAIL: stopped by the time limit"))
    ok = {"parity": lambda: parity(dry), "graphs": lambda: graphs(dry), "speed": lambda: speed(dry, a.quant, a.modes),
          "serve": lambda: serve(dry), "attention": lambda: attention(dry)}[a.part]()
    if ok is None:
        return
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
