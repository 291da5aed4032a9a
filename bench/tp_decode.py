"""One rank of bench/decode.py's tensor-parallel runs, started by torchrun (gloo, CPU):

    torchrun --standalone --nproc-per-node N bench/tp_decode.py FOLDER OUT.json [--reps 5] [--dtensor]

loads FOLDER (Meta layout) with llama2.tp_llama on N ranks and measures, at batch 1 and 8:
generate.generate tokens/s (prompt 32, 64 new tokens, greedy); the raw decode step
(Transformer.forward of one token per row); and, when N > 1, the collectives of one step
on their own: 2 all-reduces per layer of (batch, 1, dim) and the all-gather of the logits.
With --dtensor it also times the same model written with separate wq/wk/wv/w1/w3 (torchtitan's
layout), sharded two ways: plain local slices + collectives.all_reduce (as llama2.py does), and
torch's DTensor (parallelize_module with ColwiseParallel/RowwiseParallel). Rank 0 writes OUT.json.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import checkpoint  # noqa: E402
import collectives  # noqa: E402
import generate  # noqa: E402
import llama2  # noqa: E402

PROMPT_LEN, NEW = 32, 64
BATCHES = (1, 8)


class NoEos:
    """The tokenizer with EOS switched off, so that every run generates exactly NEW tokens."""
    eos_id = -1
    stop_ids = frozenset()

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


def prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(3, vocab, (batch, PROMPT_LEN), generator=g).tolist()


def median_time(fn, reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def barrier():
    if dist.is_initialized():
        dist.barrier()


def generate_tokens_per_s(model, tokenizer, batch: int, reps: int) -> float:
    p = prompts(batch, model.vocab_size)
    t = median_time(lambda: generate.generate(model, p, NEW, temperature=0.0, tokenizer=tokenizer), reps)
    return batch * NEW / t


def step_ms(model, batch: int, staggered: bool = False, steps: int = NEW) -> float:
    """Median time of one decode step (one token per row at positions 32, 33, ...), after a
    prefill, on the model's device. staggered: row i is i positions behind row 0, as
    sequences that started at different times are (per-row positions: a mask and indexed
    KV-cache writes)."""
    device = model.device
    model(torch.tensor(prompts(batch, model.vocab_size), device=device), 0)
    tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
    times = []
    for pos in range(PROMPT_LEN, PROMPT_LEN + steps):
        start_pos = [pos - i for i in range(batch)] if staggered else pos
        sync(device)
        start = time.perf_counter()
        model(tokens, start_pos)
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def sync(device: torch.device):
    if device.type == "cuda":  # kernels run asynchronously: wait for them before reading the clock
        torch.cuda.synchronize()


def step_bytes(model: llama2.Transformer) -> int:
    """Bytes of weights one decode step reads: everything but the embedding table, of
    which it reads one row per token. Quantized weights and their scales are buffers."""
    return sum(t.numel() * t.element_size() for name, t in [*model.named_parameters(), *model.named_buffers()]
               if not name.startswith(("tok_embeddings", "freqs_cis")))


def comm_ms(args: llama2.ModelArgs, batch: int, gather: bool) -> float:
    """The collectives of one decode step on their own (the ranks start them together)."""
    x = torch.randn(batch, 1, args.dim)
    logits = torch.randn(batch, 1, args.vocab_size // dist.get_world_size())

    def step():
        for _ in range(2 * args.n_layers):
            collectives.all_reduce(x)
        if gather:
            collectives.all_gather_last_dim(logits, dist.group.WORLD)

    return median_time(lambda: [step() for _ in range(NEW)], 3) / NEW * 1e3


# --- the same model with separate projections, for DTensor -----------------------------

class Block(nn.Module):
    """A Llama block with separate wq/wk/wv and w1/w3 (Meta's names, torchtitan's layout),
    for ColwiseParallel/RowwiseParallel. reduce() all-reduces row-parallel outputs when the
    weights are plain local slices; under DTensor RowwiseParallel does it."""

    def __init__(self, args: llama2.ModelArgs, max_batch: int, max_seq: int):
        super().__init__()
        self.head_dim = args.head_dim
        dim, hidden = args.dim, args.ffn_hidden_dim
        self.attention = nn.Module()
        for name, shape in (("wq", (args.n_heads * self.head_dim, dim)), ("wk", (args.n_kv_heads * self.head_dim, dim)),
                            ("wv", (args.n_kv_heads * self.head_dim, dim)), ("wo", (dim, args.n_heads * self.head_dim))):
            setattr(self.attention, name, nn.Linear(shape[1], shape[0], bias=False))
        self.feed_forward = nn.Module()
        for name, (i, o) in (("w1", (dim, hidden)), ("w3", (dim, hidden)), ("w2", (hidden, dim))):
            setattr(self.feed_forward, name, nn.Linear(i, o, bias=False))
        self.attention_norm = llama2.RMSNorm(dim, args.norm_eps)
        self.ffn_norm = llama2.RMSNorm(dim, args.norm_eps)
        self.cache_shape = (max_batch, args.n_kv_heads, max_seq, self.head_dim)
        self.plain_group = None

    def reduce(self, x):
        if self.plain_group is not None:
            collectives.all_reduce(x, self.plain_group)
        return x

    def forward(self, x, pos: int, freqs_cis):
        a, f = self.attention, self.feed_forward
        b, s, _ = x.shape
        h = self.attention_norm(x)
        xq = llama2.rotate(a.wq(h).view(b, s, -1, self.head_dim), freqs_cis)
        xk = llama2.rotate(a.wk(h).view(b, s, -1, self.head_dim), freqs_cis)
        xv = a.wv(h).view(b, s, -1, self.head_dim)
        if not hasattr(self, "cache_k"):  # local heads are known only after sharding
            shape = (self.cache_shape[0], xk.shape[2]) + self.cache_shape[2:]
            self.cache_k, self.cache_v = torch.zeros(shape), torch.zeros(shape)
        self.cache_k[:b, :, pos:pos + s] = xk.transpose(1, 2)
        self.cache_v[:b, :, pos:pos + s] = xv.transpose(1, 2)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), self.cache_k[:b, :, :pos + s],
                                             self.cache_v[:b, :, :pos + s], is_causal=s > 1)
        x = x + self.reduce(a.wo(out.transpose(1, 2).reshape(b, s, -1)))
        h = self.ffn_norm(x)
        return x + self.reduce(f.w2(F.silu(f.w1(h)) * f.w3(h)))


class SeparateLlama(nn.Module):
    def __init__(self, args: llama2.ModelArgs, max_batch: int, max_seq: int):
        super().__init__()
        self.vocab_size = args.vocab_size
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, max_batch, max_seq) for _ in range(args.n_layers))
        self.norm = llama2.RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.freqs_cis = llama2.precompute_freqs_cis(args.head_dim, max_seq, args.rope_theta)
        self.gather_group = None

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    @torch.inference_mode()
    def forward(self, tokens, pos: int):
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[pos:pos + tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, pos, freqs_cis)
        logits = self.output(self.norm(h))
        if self.gather_group is not None:
            logits = collectives.all_gather_last_dim(logits, self.gather_group)
        return logits


def separate_llama(folder: str, args: llama2.ModelArgs, how: str) -> SeparateLlama:
    """The checkpoint in SeparateLlama, sharded by `how`: "plain" (each rank slices its
    part, as llama2.py does) or "dtensor" (parallelize_module)."""
    model = SeparateLlama(args, max(BATCHES), PROMPT_LEN + NEW)
    state = checkpoint.load_pth(os.path.join(folder, "consolidated.00.pth"))
    model.load_state_dict({k: v for k, v in state.items() if k != "rope.freqs"})
    rank, ws = dist.get_rank(), dist.get_world_size()
    if how == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (ws,))
        plan = {"output": ColwiseParallel(output_layouts=Replicate())}
        for i in range(args.n_layers):
            for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
                plan[f"layers.{i}.{name}"] = ColwiseParallel()
            for name in ("attention.wo", "feed_forward.w2"):
                plan[f"layers.{i}.{name}"] = RowwiseParallel()
        parallelize_module(model, mesh, plan)
    else:
        def keep(linear: nn.Linear, dim: int):
            linear.weight = nn.Parameter(linear.weight.chunk(ws, dim)[rank].contiguous())

        for layer in model.layers:
            for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv, layer.feed_forward.w1,
                        layer.feed_forward.w3):
                keep(lin, 0)
            keep(layer.attention.wo, 1)
            keep(layer.feed_forward.w2, 1)
            layer.plain_group = dist.group.WORLD
        keep(model.output, 0)
        model.gather_group = dist.group.WORLD
    return model.eval().requires_grad_(False)


def dtensor_comparison(folder: str, ours) -> dict:
    """Decode-step times of ours (fused), SeparateLlama plain and SeparateLlama DTensor,
    and the largest logit difference of each from ours."""
    tokens = torch.tensor(prompts(1, ours.vocab_size))
    reference = ours(tokens, 0)
    out = {"ours": {b: step_ms(ours, b) for b in BATCHES}}
    for how in ("plain", "dtensor"):
        model = separate_llama(folder, ours.model.params, how)
        out[f"{how}_max_diff"] = (model(tokens, 0) - reference).abs().max().item()
        out[how] = {b: step_ms(model, b) for b in BATCHES}
        del model
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("out")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtensor", action="store_true")
    a = ap.parse_args()
    ws = int(os.environ.get("WORLD_SIZE", 1))
    llama = llama2.tp_llama(None, a.folder, os.path.join(a.folder, "tokenizer.model"), ws,
                            max_batch_size=max(BATCHES), max_seq_len=PROMPT_LEN + NEW)
    runner, tokenizer = llama.runner, NoEos(llama.tokenizer)
    result = {"tp": ws, "threads": torch.get_num_threads(),
              "generate": {b: generate_tokens_per_s(runner, tokenizer, b, a.reps) for b in BATCHES},
              "step_ms": {b: step_ms(runner, b) for b in BATCHES}}
    if ws > 1:
        result["comm_ms"] = {b: comm_ms(llama.model.params, b, llama.model.output_group is not None) for b in BATCHES}
        if a.dtensor:
            result["dtensor"] = dtensor_comparison(a.folder, runner)
    if collectives.tp_world()[0] == 0:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
