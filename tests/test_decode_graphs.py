"""ModelRunner.compile_decode(cuda_graphs=True) on CPU: the bucketed decode steps that CUDA
graphs replay on a GPU (rows padded to a rows bucket with rows that touch only a scratch
block, block tables padded to a blocks bucket) give the eager logits, with either attention
backend (FlexAttention's block masks made from the padded tables), never recompile once
compile_decode returns, and leave the cache rows outside the batch as they were. No GPU here: the capture itself is
checked by bench/gpu_check.sh (part graphs)."""

import pytest
import torch

import llama2
from conftest import TOKENIZER
from runner import buckets
from tp_worker import max_diff

pytestmark = pytest.mark.slow  # torch.compile

MAX_BATCH, MAX_SEQ_LEN, PROMPT = 8, 80, 20


def decode(model) -> list[torch.Tensor]:
    """A prefill of every row, then steps in which the first n rows go on (n varies, as in
    the engine when sequences leave and join), some rows behind the others; rows 3.. sit
    steps out and resume later, so padding rows must not have touched their caches. Row 0
    crosses the first blocks bucket (4 blocks of 16 tokens)."""
    device = model.device  # bench/gpu_check.py runs this on a GPU
    prompt = torch.randint(3, model.vocab_size, (MAX_BATCH, PROMPT), generator=torch.Generator().manual_seed(0))
    outs = [model(prompt.to(device), 0)[:, -1:]]
    lengths = [PROMPT - (i % 3) for i in range(MAX_BATCH)]
    for step in range(56):
        n = (1, 3, 8, 5, 2, 8, 4)[step % 7]
        tokens = torch.tensor([[(7 * step + i) % (model.vocab_size - 3) + 3] for i in range(n)])
        positions = lengths[:n]
        same = len(set(positions)) == 1
        outs.append(model(tokens.to(device), positions[0] if same and step % 2 else positions))
        for i in range(n):
            lengths[i] += 1
    return outs


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_bucketed_graph_steps_equal_eager(checkpoints, attention):
    """Eager with gather + SDPA, the reference, against the padded steps compiled with each
    attention backend."""
    model = llama2.tp_llama(None, checkpoints["gqa"][1]["hf"], TOKENIZER, 1, max_batch_size=MAX_BATCH,
                            max_seq_len=MAX_SEQ_LEN, attention="sdpa").runner
    eager = decode(model)
    model.attention = attention
    model.compile_decode(cuda_graphs=True)
    assert model.decode_buckets == ([1, 2, 4, 8], [4, 5])  # rows; blocks of 16 tokens
    with torch._dynamo.config.patch(error_on_recompile=True):
        graphs = decode(model)
    for i, (a, b) in enumerate(zip(eager, graphs)):
        assert max_diff(a, b) <= 1e-5, f"step {i}"


def test_buckets():
    assert buckets(8, 1) == [1, 2, 4, 8]
    assert buckets(6, 1) == [1, 2, 4, 6]
    assert buckets(2048, 64) == [64, 128, 256, 512, 1024, 2048]
    assert buckets(40, 64) == [40]
