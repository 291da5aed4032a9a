"""collectives.py on CPU: through the shared-memory segment (the default), the
tensor-parallel collectives give what gloo gives for the same inputs (the same bits at TP=2, where a sum has one
order; within rounding at TP=4), every rank gets the same bits, tensors larger than a
slot go through gloo, a rank that dies makes the others raise instead of waiting for
ever, and ranks whose collectives disagree raise instead of summing. With
LLAMA_CPU_COLLECTIVES=gloo, or without room for the segment, gloo on every rank, with the
segment's results. The segment's file is gone after set-up, also when a rank raises in
it, and a set-up removes the files that dead makers left, never a living one's."""

import os
import subprocess

import pytest
import torch

import collectives
from collectives_worker import inputs
from torchrun import run

pytestmark = pytest.mark.slow  # torchrun ranks


@pytest.fixture
def shm(monkeypatch):
    """The default: nothing set."""
    monkeypatch.delenv("LLAMA_CPU_COLLECTIVES", raising=False)


@pytest.fixture(scope="module")
def through_segment(tmp_path_factory):
    """ops' results on two ranks through the shared-memory segment (the default)."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("LLAMA_CPU_COLLECTIVES", raising=False)
        results = run("collectives_worker.py", 2, tmp_path_factory.mktemp("segment"), "ops")
    assert all(r["segment"] for r in results), "the shared-memory segment is not in use"
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_equal_gloo_on_every_rank(tmp_path, world_size, shm):
    results = run("collectives_worker.py", world_size, tmp_path, "ops")
    assert all(r["segment"] for r in results), "the shared-memory segment is not in use"
    assert not os.listdir(tmp_path / "segments"), "the segment's file outlived the set-up"
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
def test_gloo_when_asked_or_without_room(tmp_path, monkeypatch, why, through_segment):
    monkeypatch.delenv("LLAMA_CPU_COLLECTIVES", raising=False)
    if why == "asked":
        monkeypatch.setenv("LLAMA_CPU_COLLECTIVES", "gloo")
    results = run("collectives_worker.py", 2, tmp_path, "ops" if why == "asked" else "no-room")
    for rank, (r, segment) in enumerate(zip(results, through_segment)):
        assert not r["segment"], rank
        assert len(r["results"]) == len(segment["results"]) == len(inputs(rank))
        for i, ((op, mine, _), (_, expected, _)) in enumerate(zip(r["results"], segment["results"])):
            assert torch.equal(mine, expected), (rank, i, op)  # two ranks: one order of summing


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


@pytest.mark.parametrize("failing", [0, 1])
def test_a_rank_raising_in_set_up_leaves_no_segment_file(tmp_path, shm, failing):
    """Rank 0 makes the file; either rank's mapping of it raises (rank 1's: rank 0 waits for
    it in a collective, which raises when rank 1 leaves)."""
    results = run("collectives_worker.py", 2, tmp_path, "setup-raises", failing, timeout=120)
    injected = results[failing]["error"]
    assert injected.startswith(f"injected: cannot map {tmp_path / 'segments'}/"), results
    assert results[1 - failing]["error"], results
    assert not os.listdir(tmp_path / "segments")


def test_set_up_removes_the_segments_of_dead_makers_only(tmp_path, shm):
    """A segment file whose maker is gone (a rank 0 killed in set-up) goes at the next set-up;
    one whose maker lives (another server's set-up: here this test's) stays, as do files not
    named by this pid namespace."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    prefix = collectives.segment_prefix()
    stale, live = f"{prefix}{ended.pid}-0", f"{prefix}{os.getpid()}-0"
    others = [f"llama-tp-1-{ended.pid}-0", "other"]  # another pid namespace's, not a segment
    (tmp_path / "segments").mkdir()
    for name in (stale, live, *others):
        (tmp_path / "segments" / name).touch()
    results = run("collectives_worker.py", 2, tmp_path, "setup")
    assert all(r["segment"] for r in results)
    assert sorted(os.listdir(tmp_path / "segments")) == sorted([live, *others])
