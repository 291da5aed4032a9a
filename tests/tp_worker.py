"""A tensor-parallel rank for test_tp.py, started by tests/torchrun.py:

    tp_worker.py OUT_DIR FOLDER [--compile]

loads FOLDER with llama2.tp_llama on WORLD_SIZE ranks, runs fixed_tokens() through the
model (run_model) and saves rank r's logits, and the shapes of its shards, to
OUT_DIR/rank{r}.pt; --compile first turns on ModelRunner.compile_decode(cpp_wrapper=True). test_model.py
runs the same functions in-process at TP=1."""

import os
import sys

import torch

BATCH, SEQLEN, PREFILL, CHUNK = 2, 10, 4, 2
ROW_PREFILL = (3, 5)  # run_rows: how many tokens each row prefills on its own, in KV-cache row (slot) i


def fixed_tokens(vocab_size: int) -> torch.Tensor:
    """The (BATCH, SEQLEN) tokens that every rank and the in-process TP=1 run use."""
    return torch.randint(0, vocab_size, (BATCH, SEQLEN), generator=torch.Generator().manual_seed(1234))


def run_decode(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of a PREFILL-token prefill, a CHUNK-token chunk at start_pos PREFILL, then
    single-token steps at start_pos, concatenated: equal to one full forward pass."""
    steps = [model(tokens[:, :PREFILL], 0), model(tokens[:, PREFILL:PREFILL + CHUNK], PREFILL)]
    for pos in range(PREFILL + CHUNK, tokens.shape[1]):
        steps.append(model(tokens[:, pos:pos + 1], pos))
    return torch.cat(steps, dim=1)


def run_rows(model, tokens: torch.Tensor) -> torch.Tensor:
    """Rows at different positions: row i prefills its first ROW_PREFILL[i] tokens alone in
    KV-cache row i (slot=i); then both rows go on together with per-row start positions
    (a list), first with a two-token chunk, then single tokens; a last step runs row 1
    alone in its slot. Returns (BATCH, n, vocab): row i's logits for its positions
    ROW_PREFILL[i] .. ROW_PREFILL[i] + n - 1 (compare with expected_rows)."""
    for i, n in enumerate(ROW_PREFILL):
        model(tokens[i:i + 1, :n], 0, slot=i)
    pos = list(ROW_PREFILL)

    def step(width):
        chunk = torch.stack([tokens[i, p:p + width] for i, p in enumerate(pos)])
        out = model(chunk, list(pos))
        for i in range(len(pos)):
            pos[i] += width
        return out

    outs = [step(2)]
    while pos[1] < tokens.shape[1] - 1:
        outs.append(step(1))
    last = model(tokens[1:2, pos[1]:pos[1] + 1], pos[1], slot=1)
    row0_last = torch.full_like(last, float("nan"))  # row 0 sat that step out
    outs.append(torch.cat([row0_last, last]))
    return torch.cat(outs, dim=1)


def expected_rows(full: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The logits of one full forward pass at the positions that run_rows returns (NaN
    where run_rows has NaN: the steps a row sat out)."""
    n = rows.shape[1]
    expected = torch.stack([full[i, start:start + n] for i, start in enumerate(ROW_PREFILL)])
    return torch.where(rows.isnan(), rows, expected)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference; NaN (a step a row sat out) must sit at the same places."""
    assert a.shape == b.shape
    assert torch.equal(a.isnan(), b.isnan())
    return (a - b).nan_to_num(0.0).abs().max().item()


def run_model(model, tokens: torch.Tensor) -> dict:
    return {"full": model(tokens, 0), "decode": run_decode(model, tokens), "rows": run_rows(model, tokens)}


def main():
    import torch.distributed as dist

    import llama2

    out_dir, folder = sys.argv[1], sys.argv[2]
    world_size = int(os.environ["WORLD_SIZE"])
    compiled = "--compile" in sys.argv
    # compiled with sdpa, as test_model.py's: these contexts never reach auto's flex, whose
    # graphs compile_decode would compile too (on a pool this size) and no step here runs
    llama = llama2.tp_llama(None, folder, None, world_size,  # the folder's own tokenizer
                            attention="sdpa" if compiled else "auto")
    rank = dist.get_rank() if world_size > 1 else 0
    runner = llama.runner
    if compiled:  # as a server compiles it: its kernels called from C++
        runner.compile_decode(cpp_wrapper=True)
    result = run_model(runner, fixed_tokens(runner.vocab_size))
    layer = llama.model.layers[0]
    result["shapes"] = {"wqkv": tuple(layer.attention.wqkv.weight.shape), "wo": tuple(layer.attention.wo.weight.shape),
                        "w13": tuple(layer.feed_forward.w13.weight.shape),
                        "w2": tuple(layer.feed_forward.w2.weight.shape),
                        "output": tuple(llama.model.output.weight.shape)}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if world_size > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
