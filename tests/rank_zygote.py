"""The process that forks the ranks of tests/torchrun.py:

    rank_zygote.py [--preload]

--preload: it imports torch and the modules the test ranks use first, once, so that a rank
starts without paying for them (about 2.5 s of CPU each, some 90 ranks a suite); one per
pytest worker, started on its first run. Without it, it imports nothing of its own (the
runs with the runtime requirements alone).

It reads one run a line on stdin (JSON: the script, its arguments, one environment per rank,
one log file per rank, the timeout), forks the ranks, waits for them (a rank that fails, or
time running out, stops the others: one left waiting in a collective would wait for ever),
and answers with what went wrong ("" when nothing did). Nothing here runs a torch operator,
so no thread pool exists when it forks."""

import atexit
import importlib
import json
import os
import runpy
import signal
import sys
import time
import traceback

PRELOADED = ["torch", "torch.distributed", "torch._dynamo", "numpy", "safetensors.torch", "collectives", "tp",
             "llama2", "generate", "engine", "sequence", "structured", "speculative", "chat_format",
             "chat_template"]


def run_rank(script: str, args: list[str], env: dict, log: str):
    """In the forked child: become `python script *args` with env, writing to log; never returns."""
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(env)
        if "torch" in sys.modules:  # preloaded: its thread count was read from this process's environment
            sys.modules["torch"].set_num_threads(int(env.get("OMP_NUM_THREADS", os.cpu_count())))
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:  # sys.exit(n); sys.exit(message): Python prints the message and ends with 1
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def wait(pids: list[int], timeout: float) -> str:
    """Wait for every rank; the first failure or the deadline kills the rest."""
    codes = {}
    deadline = time.monotonic() + timeout
    failed = ""
    while len(codes) < len(pids):
        for r, pid in enumerate(pids):
            if r not in codes and (done := os.waitpid(pid, os.WNOHANG))[0]:
                codes[r] = os.waitstatus_to_exitcode(done[1])
                if codes[r] and not failed:
                    failed = f"rank {r} exited with {codes[r]}"
        if failed or time.monotonic() > deadline:
            failed = failed or f"timed out after {timeout} s"
            break
        time.sleep(0.05)
    for r, pid in enumerate(pids):
        if r not in codes:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return failed


def main():
    if "--preload" in sys.argv:
        for name in PRELOADED:
            importlib.import_module(name)
    for line in sys.stdin:
        run = json.loads(line)
        pids = []
        for env, log in zip(run["envs"], run["logs"]):
            pid = os.fork()
            if pid == 0:
                run_rank(run["script"], run["args"], env, log)
            pids.append(pid)
        print(json.dumps({"failed": wait(pids, run["timeout"])}), flush=True)


if __name__ == "__main__":
    main()
