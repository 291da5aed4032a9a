"""Where one decode step's time goes, eager and compiled (issue 43's profile):

    python bench/decode_profile.py [--checkpoint GGUF] [--quant int4] [--threads 2] [--no-write]

In a process of its own for each of eager and compiled (handler.compile), SmolLM2 from its
GGUF file (QUANT int4 by default), batch 1, greedy: the engine's step (Engine.step) against
the network's forward pass inside it (Runner.forward_batch), the median of STEPS steps, so
that step - forward is the engine's own time (batch, sampling, appending, stop checks); the
same with the model cut to its first layer, where the engine's share shows most; and
torch.profiler's operators by their own CPU time over PROFILED steps of the whole model.
Writes BENCHMARKS.md's decode_profile section.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]
import report  # noqa: E402

SMOLLM2 = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
STEPS, PROFILED, TOP = 64, 32, 12


def measure(checkpoint: str, quant: str, threads: int, compiled: bool, layers: int | None) -> dict:
    """Prints one process's figures as JSON (main runs it in a process of its own)."""
    import torch

    torch.set_num_threads(threads)
    from engine import Engine
    from llama2 import tp_llama
    from sequence import SamplingParams

    llama = tp_llama(None, checkpoint, checkpoint, 1, max_batch_size=1, max_seq_len=512,
                     quantization=None if quant == "none" else quant)
    if layers:
        llama.model.layers = llama.model.layers[:layers]
    runner = llama.runner
    start = time.perf_counter()
    if compiled:
        runner.compile_decode(cpp_wrapper=True)  # as the server compiles it
    compile_s = time.perf_counter() - start
    forward_s = []
    forward_batch = runner.forward_batch

    def timed(batch):
        begin = time.perf_counter()
        logits = forward_batch(batch)
        forward_s.append(time.perf_counter() - begin)
        return logits
    runner.forward_batch = timed
    engine = Engine(runner, llama.tokenizer)
    engine.add(llama.tokenizer.encode("Once upon a time", bos=True, eos=False),
               SamplingParams(max_gen_len=STEPS + PROFILED + 24, temperature=0, ignore_eos=True))
    for _ in range(16):  # the prompt, then warm decode steps
        engine.step()
    forward_s.clear()
    step_s = []
    for _ in range(STEPS):
        begin = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - begin)
    out = {"step_ms": statistics.median(step_s) * 1e3, "forward_ms": statistics.median(forward_s) * 1e3,
           "compile_s": compile_s}
    if not layers:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(PROFILED):
                engine.step()
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        out["ops"] = [(e.key, e.self_cpu_time_total / PROFILED / 1e3, e.count // PROFILED) for e in ops[:TOP]]
        out["ops_total_ms"] = sum(e.self_cpu_time_total for e in ops) / PROFILED / 1e3
    return out


def in_process(a, compiled: bool, layers: int | None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONPATH=ROOT)
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", json.dumps([compiled, layers]),
           "--checkpoint", a.checkpoint, "--quant", a.quant, "--threads", str(a.threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=SMOLLM2)
    ap.add_argument("--quant", default="int4", choices=["none", "int8", "int4"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(measure(a.checkpoint, a.quant, a.threads, *json.loads(a.measure))))
        return
    runs = {(c, layers): in_process(a, c, layers) for c in (False, True) for layers in (None, 1)}
    lines = ["## Where a decode step's time goes", "",
             f"{report.header()}; `python bench/decode_profile.py {' '.join(sys.argv[1:])}`.", "",
             f"{os.path.basename(a.checkpoint)}, QUANT={a.quant}, batch 1, greedy, {a.threads} threads, in-process "
             f"(no server): the median of {STEPS} steps. The engine's own time is a step's time less the "
             "network's forward pass in it (building the batch, sampling, appending the token, stop checks).", "",
             "| decode step | model | step (ms) | forward pass (ms) | engine's own (ms) | tokens/s |",
             "|---|---|---|---|---|---|"]
    for (compiled, layers), r in runs.items():
        lines.append(f"| {'compiled' if compiled else 'eager'} | {'first layer only' if layers else 'all layers'} "
                     f"| {r['step_ms']:.2f} | {r['forward_ms']:.2f} | {r['step_ms'] - r['forward_ms']:.2f} "
                     f"| {1e3 / r['step_ms']:.1f} |")
    for compiled in (False, True):
        r = runs[compiled, None]
        how = f"Compiled (compiled in {r['compile_s']:.0f} s)" if compiled else "Eager"
        lines += ["", f"{how}: operators by their own CPU time per step, of {r['ops_total_ms']:.2f} ms that the "
                  f"profiler saw ({PROFILED} steps, torch.profiler; its own overhead included).", "",
                  "| operator | ms per step | calls per step |", "|---|---|---|"]
        lines += [f"| `{name}` | {ms:.3f} | {count} |" for name, ms, count in r["ops"]]
    report.publish("decode_profile", "\n".join(lines), write=not a.no_write)


if __name__ == "__main__":
    main()
