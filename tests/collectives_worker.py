"""A rank for test_collectives.py, started by tests/torchrun.py:

    collectives_worker.py OUT_DIR ops|no-room|peer-dies|out-of-step|setup|setup-raises [RANK]

The segment's file is made in OUT_DIR/segments, apart from other runs' in /dev/shm.

ops: a run of all-reduces, all-gathers and broadcasts of varied shapes and dtypes, some
larger than a shared-memory slot (gloo then), the ranks reaching them at different
moments; each result next to gloo's for the same input. Saves whether the segment is in
use and the results to OUT_DIR/rank{r}.pt. no-room: the same where the segment cannot be made.
peer-dies: rank 1 exits; rank 0's next all-reduce must raise, naming rank 1, rather than
wait for ever. Rank 0 saves the error and how long it took. out-of-step: the ranks
all-reduce tensors of different sizes; each saves the error it gets. setup: only the
set-up. setup-raises RANK: mapping the segment raises on rank RANK, an error that set-up
does not expect (it names the file); each rank saves the error its set-up ends with."""

import mmap
import os
import random
import sys
import time

import torch
import torch.distributed as dist

import collectives
import tp

DTYPES = (torch.float32, torch.bfloat16, torch.int64)


def inputs(rank: int) -> list[tuple[str, torch.Tensor]]:
    """The same sequence of operations on every rank, each rank's own values."""
    shapes = random.Random(0)
    gen = torch.Generator().manual_seed(100 + rank)
    ops = []
    for i in range(60):
        dtype = DTYPES[i % 3]
        shape = (shapes.randint(1, 9), shapes.choice([1, 7, 64, 512]))
        if i % 20 == 19:  # more than a slot (1 MB): gloo
            shape = (300, 1024)
        x = torch.randn(shape, generator=gen) * 10
        ops.append((("all_reduce", "all_gather", "broadcast")[i % 3 if i % 4 else 0], x.to(dtype)))
    return ops


def run_ops(rank: int) -> list:
    jitter = random.Random(rank)
    results = []
    for op, x in inputs(rank):
        if jitter.random() < 0.3:  # ranks arrive apart: a fast rank runs ahead into the next buffer
            time.sleep(jitter.random() * 0.01)
        if op == "all_reduce":
            mine, theirs = x.clone(), x.clone()
            collectives.all_reduce(mine)
            dist.all_reduce(theirs)
        elif op == "all_gather":
            mine = collectives.all_gather_last_dim(x)
            parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, x)
            theirs = torch.cat(parts, dim=-1)
        else:
            mine, theirs = x.clone(), x.clone()
            collectives.broadcast(mine, src=1)
            dist.broadcast(theirs, src=1)
        results.append((op, mine, theirs))
    return results


def cannot_map(fileno: int, size: int):
    raise RuntimeError(f"injected: cannot map {os.readlink(f'/proc/self/fd/{fileno}')}")


def set_up_raises(out_dir: str, failing: int):
    rank = int(os.environ["RANK"])
    if rank == failing:
        mmap.mmap = cannot_map
    try:
        tp.init_distributed(int(os.environ["WORLD_SIZE"]))
        error = None
    except RuntimeError as e:  # on the other rank, gloo's: its peer left
        error = str(e)
    torch.save({"error": error}, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # as a rank whose set-up failed: gone, its group never destroyed


def main():
    out_dir, mode = sys.argv[1], sys.argv[2]
    collectives.SEGMENTS = os.path.join(out_dir, "segments")
    os.makedirs(collectives.SEGMENTS, exist_ok=True)
    if mode == "no-room":  # no place for the segment: gloo
        collectives.SEGMENTS, mode = os.path.join(out_dir, "missing"), "ops"
    if mode == "setup-raises":
        set_up_raises(out_dir, int(sys.argv[3]))
    tp.init_distributed(int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    out = {"segment": collectives._channel is not None}
    if mode == "ops":
        out["results"] = run_ops(rank)
    elif mode == "out-of-step":
        try:
            collectives.all_reduce(torch.ones(8 >> rank, 64))
            out["error"] = None
        except collectives.OutOfStep as e:
            out["error"] = str(e)
    elif mode == "peer-dies":
        x = torch.ones(8, 64)
        collectives.all_reduce(x)  # both ranks are here
        if rank == 1:
            torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
            os._exit(0)  # gone without a word, as a killed rank
        begin = time.monotonic()
        try:
            collectives.all_reduce(x)
            out["error"] = None
        except RuntimeError as e:
            out["error"] = str(e)
        out["seconds"] = time.monotonic() - begin
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    if mode in ("ops", "setup"):
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
