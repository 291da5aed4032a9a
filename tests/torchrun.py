"""Run a script's ranks on CPU (gloo) as torchrun starts them, and collect what each rank saved.

The ranks are started here, with the environment torchrun gives its workers, and meet at a
TCPStore that this process holds, as torchrun's agent does (TORCHELASTIC_USE_AGENT_STORE): no
launcher process that imports torch, no rendezvous, and no wait for the agent to shut down
(about 2 s of CPU and 5 s of wall time a run, docs/test-suite.md)."""

import os
import subprocess
import sys
import tempfile
import time

import torch
from runtime import environment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script: str, nproc: int, out_dir, *args, timeout: int = 300, runtime_only: bool = False) -> list:
    """Run tests/<script> on nproc ranks. The script gets out_dir and args, and saves rank r's
    result to out_dir/rank{r}.pt; returns those results in rank order. runtime_only: with
    the runtime requirements alone (tests/runtime.py)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    if runtime_only:
        env = environment(out_dir, env)
    cmd = [sys.executable, os.path.join(ROOT, "tests", script), str(out_dir), *map(str, args)]
    failed, output = run_ranks(cmd, env, nproc, timeout)
    assert not failed, f"{failed}:\n{output[-8000:]}"
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True) for r in range(nproc)]


def run_ranks(cmd: list, env: dict, nproc: int, timeout: int) -> tuple[str, str]:
    """Start nproc ranks of cmd and wait for them (conftest's guard replaces this in the quick
    tier). Where a rank fails or time runs out, the others are stopped: a rank left waiting
    in a collective would wait for ever. Returns what went wrong ("" when nothing did) and
    the ranks' output, one after the other."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    shared = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(nproc),
                  LOCAL_WORLD_SIZE=str(nproc), TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    logs = [tempfile.TemporaryFile("w+") for _ in range(nproc)]
    ranks = [subprocess.Popen(cmd, env=dict(shared, RANK=str(r), LOCAL_RANK=str(r)), stdout=log,
                              stderr=subprocess.STDOUT, text=True) for r, log in enumerate(logs)]
    deadline = time.monotonic() + timeout
    while not (failed := first_failure(ranks)) and any(rank.poll() is None for rank in ranks):
        if time.monotonic() > deadline:
            failed = f"timed out after {timeout} s"
            break
        time.sleep(0.05)
    for rank in ranks:
        if rank.poll() is None:
            rank.kill()
        rank.wait()
    return failed, "".join(f"--- rank {r}\n{read(log)}" for r, log in enumerate(logs))


def read(log) -> str:
    log.seek(0)
    with log:
        return log.read()


def first_failure(ranks: list[subprocess.Popen]) -> str:
    return next((f"rank {r} exited with {rank.returncode}" for r, rank in enumerate(ranks) if rank.poll()), "")
