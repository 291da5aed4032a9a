"""The handler's configuration, read one way: model-config.yaml's handler section into a
ServingConfig, each setting checked when it is made, so that a bad one is refused with its
key (handler.overlap must be auto, true or false, got 'maybe'). tools/configure.py reads it
before TorchServe starts, so that `make serve` refuses in seconds, and the handler again
when each worker loads. The `auto` settings depend on the machine a worker runs on:
resolve() decides them from its facts (Machine)."""

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Literal

import torch

import quant
from api import Defaults, Limits, dataclass_from
from runner import ATTENTION

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO = "auto"
Auto = Literal["auto"]
# Steps in turn with TorchServe's round trip: an iteration runs at least 4 steps, more if they
# fit in 200 ms (at most 16), so that the round trip and the slower first step after it cost
# little; a request that arrives meanwhile waits that long to start, and a stream comes in
# chunks that far apart (docs/tuning-log.md: fewer steps for slow models, and a 100 ms
# budget, measured slower).
IN_TURN_SECONDS, IN_TURN_STEPS = 0.2, (4, 16)


def whole(value, least: int) -> bool:
    return type(value) is int and value >= least  # YAML's true is a bool, not a number here


def number(value) -> bool:
    return type(value) in (int, float) and 0 <= value < math.inf


def flag(value) -> bool:
    return type(value) is bool


def a_path(value) -> bool:
    return isinstance(value, str) and value != ""


def one_of(*choices: str) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, str) and value in choices


def setting(default, must: str, ok: Callable[[Any], bool]):
    """A handler setting: its default (README: Configuration), what a value must be (as the
    refusal says it) and the test of a value."""
    return field(default=default, metadata={"must": must, "ok": ok})


def at_least(least: int) -> tuple[str, Callable[[Any], bool]]:
    return f"a whole number >= {least}", lambda value: whole(value, least)


def from_to(least: int, most: int) -> tuple[str, Callable[[Any], bool]]:
    return f"a whole number from {least} to {most}", lambda value: whole(value, least) and value <= most


# What each number in handler.limits and handler.defaults must be: a limit of 0 prompts or new
# tokens would refuse every request, and a default must be a value the API accepts.
SECTION_RULES = {
    "limits.max_new_tokens": at_least(1),
    "limits.max_prompt_tokens": at_least(0),  # 0: whatever max_seq_len leaves room for
    "limits.max_prompts": at_least(1),
    "limits.max_messages": at_least(1),
    "limits.max_body_bytes": at_least(1024),
    "defaults.max_new_tokens": at_least(1),
    "defaults.temperature": ("a number from 0 to 2", lambda value: number(value) and value <= 2),
    "defaults.top_p": ("a number above 0, at most 1", lambda value: number(value) and 0 < value <= 1),
    "defaults.top_k": at_least(0),
}


@dataclass
class Speculative:
    """handler.speculative: proposed tokens verified in the decode steps (speculative.py)."""
    method: str = setting("off", "off, ngram or draft", one_of("off", "ngram", "draft"))
    k: int = setting(4, *from_to(1, 32))  # tokens proposed per step
    ngram_min: int = setting(1, *from_to(1, 32))  # prompt lookup's n-grams
    ngram_max: int = setting(3, *from_to(1, 32))
    # method draft: the draft model's checkpoint (same tokenizer), relative to the archive or absolute
    draft: str | None = setting(None, "a path", lambda value: value is None or a_path(value))
    # speculate while at most this many sequences decode (BENCHMARKS.md, speculative decoding)
    max_batch: int = setting(2, *at_least(0))

    def __post_init__(self):
        refuse_bad_settings(self, "handler.speculative.")
        if self.ngram_max < self.ngram_min:
            raise ValueError(f"handler.speculative.ngram_max must be at least ngram_min {self.ngram_min}, "
                             f"got {self.ngram_max}")
        if (self.method == "draft") != (self.draft is not None):
            raise ValueError("handler.speculative.draft must be given with method draft, and only then")


@dataclass
class ServingConfig:
    """model-config.yaml's handler section; a setting it leaves out gets the default here."""
    checkpoint: str = setting("weights", "a path", a_path)  # relative to the archive, or absolute
    # a tokenizer file, or a folder with tokenizer.json or tokenizer.model; None: the checkpoint's
    tokenizer: str | None = setting(None, "a path", lambda value: value is None or a_path(value))
    max_seq_len: int = setting(512, *at_least(1))
    dtype: str = setting(AUTO, f"auto or one of {sorted(DTYPES)}", one_of(AUTO, *DTYPES))
    compile: bool = setting(False, "true or false", flag)
    kv_cache_bytes: int = setting(0, *at_least(0))
    # a share of the GPU memory left free after loading, instead of kv_cache_bytes (GPU only)
    kv_cache_memory: float = setting(0, "a number from 0 to 1", lambda value: number(value) and value <= 1)
    attention: str = setting("auto", "auto, flex or sdpa", one_of(*ATTENTION))
    max_batched_tokens: Auto | int = setting(AUTO, "auto or a whole number >= 0",
                                             lambda value: value == AUTO or whole(value, 0))
    overlap: Auto | bool = setting(AUTO, "auto, true or false", lambda value: value == AUTO or flag(value))
    steps_per_iteration: Auto | int = setting(AUTO, "auto or a whole number >= 1",
                                              lambda value: value == AUTO or whole(value, 1))
    prefix_caching: bool = setting(True, "true or false", flag)
    # a step starts before the host has the last one's tokens (engine.py, Engine.step)
    async_scheduling: bool = setting(False, "true or false", flag)
    quantization: str = setting("none", f"none, {', '.join(quant.MODES[:-1])} or {quant.MODES[-1]}",
                                one_of("none", *quant.MODES))
    # int8 and int4 on a CPU with AVX512-VNNI: x rounded to int8 blocks at a few rows (faster
    # decode at small batches; compiled and eager answers may then part: docs/quantization.md)
    int8_activations: bool = setting(False, "true or false", flag)
    limits: Limits = field(default_factory=Limits)
    defaults: Defaults = field(default_factory=Defaults)
    speculative: Speculative = field(default_factory=Speculative)

    def __post_init__(self):
        refuse_bad_settings(self, "handler.")
        if self.kv_cache_memory and self.kv_cache_bytes:
            raise ValueError("give handler.kv_cache_bytes or handler.kv_cache_memory, not both")
        if self.int8_activations and self.quantization not in ("int8", "int4"):
            raise ValueError(f"handler.int8_activations needs handler.quantization int8 or int4, "
                             f"got {self.quantization}")
        if self.async_scheduling and self.speculative.method != "off":
            raise ValueError("handler.async_scheduling cannot run with handler.speculative: proposing tokens "
                             "needs the last ones on the host")
        for name in ("limits", "defaults"):
            section = getattr(self, name)
            for f in fields(section):
                refuse_unless(f"handler.{name}.{f.name}", getattr(section, f.name), *SECTION_RULES[f"{name}.{f.name}"])

    @classmethod
    def from_model_config(cls, config: dict) -> "ServingConfig":
        """The handler's settings in a model-config.yaml as yaml.safe_load reads it; a
        ValueError names the first setting the handler cannot serve with."""
        if config.get("continuousBatching") is not True:
            raise ValueError("model-config.yaml must set continuousBatching: true (this handler batches "
                             "requests step by step)")
        refuse_unless("batchSize", config.get("batchSize", 1), *at_least(1))
        handler = config.get("handler") or {}
        refuse_unless("handler", handler, "a mapping of settings", lambda value: isinstance(value, dict))
        names = [f.name for f in fields(cls)]
        unknown = sorted(str(key) for key in handler if key not in names)
        if unknown:
            raise ValueError(f"unknown keys in the handler section of model-config.yaml: "
                             f"{', '.join('handler.' + key for key in unknown)} (the keys are {', '.join(names)})")
        sections = {}
        for name, section in (("limits", Limits), ("defaults", Defaults), ("speculative", Speculative)):
            values = handler.get(name)
            refuse_unless(f"handler.{name}", values, "a mapping of settings",
                          lambda value: value is None or isinstance(value, dict))
            sections[name] = dataclass_from(section, values, f"handler.{name}")
        return cls(**handler | sections)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """None for auto: the loader picks by device (bfloat16 on GPU, float32 on CPU)."""
        return DTYPES.get(self.dtype)

    @property
    def quantization_mode(self) -> str | None:
        return None if self.quantization == "none" else self.quantization

    def resolve(self, machine: "Machine") -> "Resolved":
        """The settings that may be auto, decided for machine."""
        overlap = self.overlap
        if overlap == AUTO:
            overlap = overlap_by_default(machine.on_gpu, machine.cores, machine.threads_in_use)
        budget = self.max_batched_tokens
        if budget == AUTO:
            budget = default_token_budget(machine.batch_size, machine.on_gpu)
        steps = (self.steps_per_iteration, self.steps_per_iteration, 0.0)
        if self.steps_per_iteration == AUTO:  # overlapped steps hide the round trip; in turn, 4+ amortize it
            steps = (1, 1, 0.0) if overlap else (*IN_TURN_STEPS, IN_TURN_SECONDS)
        return Resolved(budget, overlap, steps)


def refuse_bad_settings(settings, prefix: str):
    """Refuse, by its key, the first of settings' fields made with setting() whose value is bad."""
    for f in fields(settings):
        if "must" in f.metadata:
            refuse_unless(prefix + f.name, getattr(settings, f.name), f.metadata["must"], f.metadata["ok"])


def refuse_unless(key: str, value, must: str, ok: Callable[[Any], bool]):
    if not ok(value):
        raise ValueError(f"{key} must be {must}, got {value!r}")


@dataclass(frozen=True)
class Machine:
    """What the auto settings depend on."""
    on_gpu: bool  # the model's weights are on a GPU
    cores: int  # the CPU cores this rank may run on
    threads_in_use: int  # the compute threads of the ranks on this machine
    batch_size: int  # batchSize: the most sequences decoded together

    @classmethod
    def here(cls, on_gpu: bool, batch_size: int, world_size: int) -> "Machine":
        """This rank's machine: its cores, and torch's threads on each of the machine's ranks."""
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        return cls(on_gpu, len(os.sched_getaffinity(0)), ranks_here * torch.get_num_threads(), batch_size)


@dataclass(frozen=True)
class Resolved:
    """The auto settings decided (ServingConfig.resolve)."""
    max_batched_tokens: int  # 0: no limit
    overlap: bool
    steps_per_iteration: tuple[int, int, float]  # (at least, at most, seconds that decide between: Engine.run)

    def __str__(self):
        least, most, seconds = self.steps_per_iteration
        steps = (f"{least} to {most} steps (those that fit in {seconds * 1000:.0f} ms)" if seconds
                 else f"{least} step(s)")
        round_trip = ", overlapping TorchServe's round trip" if self.overlap else ""
        return f"{self.max_batched_tokens or 'unlimited'} tokens per step, {steps} per iteration{round_trip}"


def overlap_by_default(on_gpu: bool, cores: int, threads_in_use: int) -> bool:
    """Whether a server should run the steps on the engine's thread while it does its own
    work (handler.overlap auto): on a GPU, whose steps leave the CPU free, and on a CPU with
    a core that the ranks' threads leave over. Where every core computes, the server's work
    takes cores from ranks that the others then wait for: measured slower than steps in
    turn with the server's (BENCHMARKS.md, serving engine)."""
    return on_gpu or cores > threads_in_use


def default_token_budget(max_seqs: int, on_gpu: bool) -> int:
    """The tokens a step computes unless configured: a step's prefill chunk should cost no
    more than about two decode steps, so that running streams stay smooth while a long
    prompt is prefilled (a longer chunk makes the decodes sharing its step that much
    slower: BENCHMARKS.md, serving engine). A GPU computes hundreds of tokens in the
    time it reads the weights once (vLLM's chunked-prefill default was 512). At least one
    token for every sequence, so that each decodes every step."""
    return max(512 if on_gpu else 64, max_seqs)
