"""Run a script's ranks on CPU (gloo) as torchrun starts them, and collect what each rank saved.

The ranks are started here, with the environment torchrun gives its workers, and meet at a
TCPStore that this process holds, as torchrun's agent does (TORCHELASTIC_USE_AGENT_STORE): no
launcher process that imports torch, no rendezvous, and no wait for the agent to shut down
(about 2 s of CPU and 5 s of wall time a run, docs/test-suite.md)."""

import json
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
    the runtime requirements alone (tests/runtime.py), in fresh processes; otherwise forked
    from this worker's tests/rank_zygote.py, which has imported torch already."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    if runtime_only:
        env = environment(out_dir, env)
    cmd = [os.path.join(ROOT, "tests", script), str(out_dir), *map(str, args)]
    failed, output = run_ranks(cmd, env, nproc, timeout, forked=not runtime_only)
    assert not failed, f"{failed}:\n{output[-8000:]}"
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True) for r in range(nproc)]


def run_ranks(cmd: list, env: dict, nproc: int, timeout: int, forked: bool = True) -> tuple[str, str]:
    """Start nproc ranks of `python *cmd` and wait for them (conftest's guard replaces this in
    the quick tier). Where a rank fails or time runs out, the others are stopped: a rank left
    waiting in a collective would wait for ever. Returns what went wrong ("" when nothing
    did) and the ranks' output, one after the other."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    shared = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(nproc),
                  LOCAL_WORLD_SIZE=str(nproc), TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    envs = [dict(shared, RANK=str(r), LOCAL_RANK=str(r)) for r in range(nproc)]
    with tempfile.TemporaryDirectory() as logs:
        paths = [os.path.join(logs, f"rank{r}.log") for r in range(nproc)]
        run_ = run_forked if forked else run_processes
        failed = run_(cmd, envs, paths, timeout)
        return failed, "".join(f"--- rank {r}\n{read(path)}" for r, path in enumerate(paths))


def run_forked(cmd: list, envs: list[dict], logs: list[str], timeout: int) -> str:
    request = {"script": cmd[0], "args": cmd[1:], "envs": envs, "logs": logs, "timeout": timeout}
    zygote = started_zygote()
    zygote.stdin.write(json.dumps(request) + "\n")
    zygote.stdin.flush()
    answer = zygote.stdout.readline()
    if not answer:
        raise RuntimeError(f"tests/rank_zygote.py exited with {zygote.wait()}")
    return json.loads(answer)["failed"]


_zygote = None


def started_zygote() -> subprocess.Popen:
    """This process's zygote, started on first use; it exits with this process (its stdin closes)."""
    global _zygote
    if _zygote is None or _zygote.poll() is not None:
        _zygote = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "rank_zygote.py")],
                                   env=dict(os.environ, PYTHONPATH=ROOT), stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
    return _zygote


def run_processes(cmd: list, envs: list[dict], logs: list[str], timeout: int) -> str:
    ranks = []
    for env, path in zip(envs, logs):
        with open(path, "w") as log:
            ranks.append(subprocess.Popen([sys.executable, *cmd], env=env, stdout=log, stderr=subprocess.STDOUT))
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
    return failed


def read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def first_failure(ranks: list[subprocess.Popen]) -> str:
    return next((f"rank {r} exited with {rank.returncode}" for r, rank in enumerate(ranks) if rank.poll()), "")
