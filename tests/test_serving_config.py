"""The handler's one configuration (serving_config): model-config.yaml's handler section read
into typed settings, each bad one refused by its key, and the auto settings decided from a
machine's facts, given here as values (tests/test_startup.py: make serve and the handler
refusing them)."""

import pytest
import torch

from api import Defaults, Limits
from serving_config import Machine, ServingConfig


def read(handler=None, **top) -> ServingConfig:
    return ServingConfig.from_model_config({"continuousBatching": True, "handler": handler} | top)


def refusal(handler=None, **top) -> str:
    with pytest.raises(ValueError) as e:
        read(handler, **top)
    return str(e.value)


@pytest.mark.parametrize("handler, message", [
    ({"overlap": "maybe"}, "handler.overlap must be auto, true or false, got 'maybe'"),
    ({"overlap": 1}, "handler.overlap must be auto, true or false, got 1"),
    ({"max_seq_len": "abc"}, "handler.max_seq_len must be a whole number >= 1, got 'abc'"),
    ({"max_seq_len": 0}, "handler.max_seq_len must be a whole number >= 1, got 0"),
    ({"max_seq_len": True}, "handler.max_seq_len must be a whole number >= 1, got True"),
    ({"kv_cache_bytes": -1}, "handler.kv_cache_bytes must be a whole number >= 0, got -1"),
    ({"kv_cache_bytes": 1.5}, "handler.kv_cache_bytes must be a whole number >= 0, got 1.5"),
    ({"dtype": "float64"}, "handler.dtype must be auto or one of ['bfloat16', 'float16', 'float32'], got 'float64'"),
    ({"dtype": ["float32"]}, "handler.dtype must be auto or one of ['bfloat16', 'float16', 'float32'], "
                             "got ['float32']"),
    ({"compile": "yes"}, "handler.compile must be true or false, got 'yes'"),
    ({"prefix_caching": 1}, "handler.prefix_caching must be true or false, got 1"),
    ({"max_batched_tokens": "64"}, "handler.max_batched_tokens must be auto or a whole number >= 0, got '64'"),
    ({"steps_per_iteration": 0}, "handler.steps_per_iteration must be auto or a whole number >= 1, got 0"),
    ({"attention": "paged"}, "handler.attention must be auto, flex or sdpa, got 'paged'"),
    ({"kv_cache_memory": 1.5}, "handler.kv_cache_memory must be a number from 0 to 1, got 1.5"),
    ({"async_scheduling": "yes"}, "handler.async_scheduling must be true or false, got 'yes'"),
    ({"async_scheduling": True, "speculative": {"method": "ngram"}}, "handler.async_scheduling cannot run with "
     "handler.speculative: proposing tokens needs the last ones on the host"),
    ({"kv_cache_memory": "90%"}, "handler.kv_cache_memory must be a number from 0 to 1, got '90%'"),
    ({"kv_cache_memory": 0.9, "kv_cache_bytes": 1 << 20}, "give handler.kv_cache_bytes or handler.kv_cache_memory, "
                                                         "not both"),
    ({"quantization": "int3"}, "handler.quantization must be none, int8, int4 or fp8, got 'int3'"),
    ({"int8_activations": "yes", "quantization": "int4"}, "handler.int8_activations must be true or false, got 'yes'"),
    ({"int8_activations": True}, "handler.int8_activations needs handler.quantization int8 or int4, got none"),
    ({"checkpoint": 7}, "handler.checkpoint must be a path, got 7"),
    ({"tokenizer": ""}, "handler.tokenizer must be a path, got ''"),
    ({"limits": {"max_prompts": "abc"}}, "handler.limits.max_prompts must be a whole number >= 1, got 'abc'"),
    ({"limits": {"max_prompts": 0}}, "handler.limits.max_prompts must be a whole number >= 1, got 0"),
    ({"limits": {"max_new_tokens": 0}}, "handler.limits.max_new_tokens must be a whole number >= 1, got 0"),
    ({"limits": {"max_messages": 0}}, "handler.limits.max_messages must be a whole number >= 1, got 0"),
    ({"limits": {"max_body_bytes": 100}}, "handler.limits.max_body_bytes must be a whole number >= 1024, got 100"),
    ({"limits": {"max_prompt_tokens": -1}}, "handler.limits.max_prompt_tokens must be a whole number >= 0, got -1"),
    ({"defaults": {"temperature": "hot"}}, "handler.defaults.temperature must be a number from 0 to 2, got 'hot'"),
    ({"defaults": {"temperature": 50}}, "handler.defaults.temperature must be a number from 0 to 2, got 50"),
    ({"defaults": {"top_p": 0}}, "handler.defaults.top_p must be a number above 0, at most 1, got 0"),
    ({"defaults": {"top_p": 1.5}}, "handler.defaults.top_p must be a number above 0, at most 1, got 1.5"),
    ({"defaults": {"max_new_tokens": 0}}, "handler.defaults.max_new_tokens must be a whole number >= 1, got 0"),
    ({"speculative": {"k": 0}}, "handler.speculative.k must be a whole number from 1 to 32, got 0"),
    ({"speculative": {"k": 1000}}, "handler.speculative.k must be a whole number from 1 to 32, got 1000"),
    ({"speculative": {"ngram_max": 99}}, "handler.speculative.ngram_max must be a whole number from 1 to 32, got 99"),
    ({"defaults": {"top_k": 0.5}}, "handler.defaults.top_k must be a whole number >= 0, got 0.5"),
    ({"limits": 5}, "handler.limits must be a mapping of settings, got 5"),
    (["overlap"], "handler must be a mapping of settings, got ['overlap']"),
])
def test_a_bad_setting_is_refused_by_its_key(handler, message):
    assert refusal(handler) == message


def test_unknown_keys_are_refused_by_name():
    assert refusal({"overlapp": True, "max_seq_len": 64, "speed": "fast"}) == (
        "unknown keys in the handler section of model-config.yaml: handler.overlapp, handler.speed (the keys are "
        "checkpoint, tokenizer, max_seq_len, dtype, compile, kv_cache_bytes, kv_cache_memory, attention, "
        "max_batched_tokens, overlap, "
        "steps_per_iteration, prefix_caching, async_scheduling, quantization, int8_activations, limits, defaults, "
        "speculative)")
    assert refusal({"limits": {"max_tokens": 9}}) == "handler.limits: unknown keys ['max_tokens']"


def test_torchserve_settings_the_handler_needs():
    with pytest.raises(ValueError, match="must set continuousBatching: true"):
        ServingConfig.from_model_config({"handler": {}})
    assert refusal(batchSize="8") == "batchSize must be a whole number >= 1, got '8'"
    assert refusal(batchSize=0) == "batchSize must be a whole number >= 1, got 0"


def test_settings_left_out_get_the_defaults_and_good_ones_are_kept():
    assert read() == ServingConfig() and read({}).limits == Limits() and read().defaults == Defaults()
    config = read({"overlap": False, "max_batched_tokens": 0, "dtype": "bfloat16", "quantization": "int4",
                   "int8_activations": True, "defaults": {"temperature": 0}, "limits": {"max_prompts": 2}}, batchSize=4)
    assert (config.overlap, config.max_batched_tokens, config.quantization_mode) == (False, 0, "int4")
    assert config.int8_activations and not read().int8_activations
    assert config.torch_dtype is torch.bfloat16 and read().torch_dtype is None  # auto: the loader decides
    assert config.defaults.temperature == 0 and config.limits == Limits(max_prompts=2)


GPU = Machine(on_gpu=True, cores=2, threads_in_use=2, batch_size=8)
CPU_WITH_A_SPARE_CORE = Machine(on_gpu=False, cores=3, threads_in_use=2, batch_size=8)
CPU_ALL_BUSY = Machine(on_gpu=False, cores=2, threads_in_use=2, batch_size=8)


@pytest.mark.parametrize("machine, overlap, budget, steps", [
    (GPU, True, 512, (1, 1, 0.0)),
    (CPU_WITH_A_SPARE_CORE, True, 64, (1, 1, 0.0)),
    (CPU_ALL_BUSY, False, 64, (4, 16, 0.2)),
    (Machine(on_gpu=False, cores=16, threads_in_use=16, batch_size=8), False, 64, (4, 16, 0.2)),
    (Machine(on_gpu=False, cores=2, threads_in_use=2, batch_size=100), False, 100, (4, 16, 0.2)),  # a token per slot
    (Machine(on_gpu=True, cores=2, threads_in_use=2, batch_size=1000), True, 1000, (1, 1, 0.0)),
])
def test_auto_settings_follow_the_machine(machine, overlap, budget, steps):
    run = ServingConfig().resolve(machine)
    assert (run.overlap, run.max_batched_tokens, run.steps_per_iteration) == (overlap, budget, steps)


def test_settings_given_are_kept_whatever_the_machine():
    run = ServingConfig(overlap=False, max_batched_tokens=0, steps_per_iteration=2).resolve(GPU)
    assert (run.overlap, run.max_batched_tokens, run.steps_per_iteration) == (False, 0, (2, 2, 0.0))
    assert str(run) == "unlimited tokens per step, 2 step(s) per iteration"
    run = ServingConfig(overlap=True).resolve(CPU_ALL_BUSY)  # steps auto: one per overlapped iteration
    assert (run.overlap, run.steps_per_iteration) == (True, (1, 1, 0.0))
    assert str(run) == "64 tokens per step, 1 step(s) per iteration, overlapping TorchServe's round trip"
    assert str(ServingConfig().resolve(CPU_ALL_BUSY)) == ("64 tokens per step, 4 to 16 steps (those that fit in "
                                                           "200 ms) per iteration")
