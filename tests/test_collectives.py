"""collectives.py on CPU: through the shared-memory segment (the default), the
tensor-parallel collectives give what gloo gives for the same inputs (the same bits at TP=2, where a sum has one
order; within rounding at TP=4), every rank gets the same bits, tensors larger than a
slot go through gloo, a rank that dies makes the others raise instead of waiting for
ever, and ranks whose collectives disagree raise instead of summing. With
LLAMA_CPU_COLLECTIVES=gloo, or without room for the segment, gloo."""

import pytest
import torch

from collectives_worker import inputs
from torchrun import run


@pytest.fixture
def shm(monkeypatch):
    """The default: nothing set."""
    monkeypatch.delenv("LLAMA_CPU_COLLECTIVES", raising=False)


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_equal_gloo_on_every_rank(tmp_path, world_size, shm):
    results = run("collectives_worker.py", world_size, tmp_path, "ops")
    assert all(r["segment"] for r in results), "the shared-memory segment is not in use"
    sent = [inputs(rank) for rank in range(world_size)]
    for i, (op, mine, theirs) in enumerate(results[0]["results"]):
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, (i, op)
        if world_size == 2 or op != "all_reduce" or mine.dtype == torch.int64:
            assert torch.equal(mine, theirs), (i, op, mine.dtype)
        else:  # four ranks: gloo adds in another order, rounding each sum; the segment rounds once
            exact = sum(s[i][1].double() for s in sent)
            bound = world_size * torch.finfo(mine.dtype).eps * sum(s[i][1].double().abs() for s in sent)
            assert ((mine.double() - exact).abs() <= bound).all(), (i, op, mine.dtype)
        for rank in range(1, world_size):
            assert torch.equal(results[rank]["results"][i][1], mine), (i, op, rank)


@pytest.mark.parametrize("why", ["asked", "no room"])
def test_gloo_when_asked_or_without_room(tmp_path, monkeypatch, why):
    monkeypatch.delenv("LLAMA_CPU_COLLECTIVES", raising=False)
    if why == "asked":
        monkeypatch.setenv("LLAMA_CPU_COLLECTIVES", "gloo")
    results = run("collectives_worker.py", 2, tmp_path, "ops" if why == "asked" else "no-room")
    assert not any(r["segment"] for r in results)
    assert all(torch.equal(mine, theirs) for _, mine, theirs in results[0]["results"])


def test_a_dead_rank_is_an_error_not_a_hang(tmp_path, shm):
    results = run("collectives_worker.py", 2, tmp_path, "peer-dies", timeout=120)
    assert results[0]["segment"]
    assert results[0]["error"] and "rank 1" in results[0]["error"], results[0]
    assert results[0]["seconds"] < 10, results[0]


def test_ranks_out_of_step_raise_instead_of_summing(tmp_path, shm):
    results = run("collectives_worker.py", 2, tmp_path, "out-of-step")
    assert all(r["segment"] for r in results)
    for r in results:
        assert r["error"] and "out of step" in r["error"], r
