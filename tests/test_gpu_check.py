"""bench/gpu_check.py's parts that grew with the attention backends and fp8, run as their CPU
dry run (small shapes, fp32): the script itself works and its checks pass on the CPU; the
GPU figures come from bench/gpu_check.sh on a GPU."""

import os

import pytest

import torchrun
from conftest import ROOT

pytestmark = pytest.mark.slow  # torch.compile


def dry_run(*part: str) -> list[str]:
    """The script's output, run in a process forked by the tests' rank zygote (torch imported)."""
    output = torchrun.output_of(os.path.join(ROOT, "bench", "gpu_check.py"), *part, "--cpu-dry-run",
                                env=dict(os.environ))
    return output.strip().splitlines()


def test_attention_part_compares_flex_with_sdpa():
    lines = dry_run("attention")
    assert lines[-1] == "PASS"
    steps = [line for line in lines if "decode step sdpa" in line]
    assert len(steps) == 4 and all(line.endswith("ok") for line in steps)  # batch 1 and 8, two contexts


def test_speed_part_skips_fp8_on_the_cpu():
    lines = dry_run("speed", "--quant", "fp8", "--modes", "eager")
    assert lines[-1].startswith("SKIP: fp8 needs a GPU") and any("this rank runs on cpu" in line for line in lines)
