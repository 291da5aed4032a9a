"""Loading one rank of a worker: the model, its tokenizer and the engine that serves them,
from the handler's settings (ServingConfig), each stage logged for tools/wait_ready.py."""

import functools
import logging
import os
import time

import block_quant
import chat_format
from engine import Engine
from llama2 import tp_llama
from serving_config import Machine, Resolved, ServingConfig
from speculative import DraftProposer, NgramProposer, Speculation

logger = logging.getLogger(__name__)


def load(config: ServingConfig, model_dir: str, batch_size: int, world_size: int,
         progress: "Progress") -> tuple[Engine, Resolved]:
    """The engine of config's checkpoint (relative to model_dir) for batch_size sequences decoded
    together (batchSize), and config's auto settings decided for this machine."""
    checkpoint = os.path.join(model_dir, config.checkpoint)
    tokenizer = os.path.join(model_dir, config.tokenizer or config.checkpoint)
    start = time.perf_counter()
    block_quant.INT8_X = config.int8_activations
    llama = tp_llama(None, checkpoint, tokenizer, world_size, dtype=config.torch_dtype,
                     max_batch_size=batch_size, max_seq_len=config.max_seq_len, kv_cache_bytes=config.kv_cache_bytes,
                     progress=progress, quantization=config.quantization_mode, attention=config.attention,
                     kv_cache_memory=config.kv_cache_memory)
    logger.info("loaded %s on %d rank(s) in %.1f s: %s", checkpoint, world_size,
                time.perf_counter() - start, llama.model.params)
    logger.info("tokenizer %s (%s), chat format %s", llama.tokenizer.path, type(llama.tokenizer).__name__,
                chat_format.format_name(llama.tokenizer))
    runner = llama.runner
    run = config.resolve(Machine.here(runner.device.type == "cuda", batch_size, world_size))
    logger.info("KV cache: %d blocks of %d tokens (%.1f MB on this rank), prefix caching %s, attention %s, "
                "async scheduling %s, %s", runner.num_blocks, runner.block_size, runner.kv_cache_bytes() / 1e6,
                "on" if config.prefix_caching else "off", runner.attention,
                "on" if config.async_scheduling else "off", run)
    engine = Engine(runner, llama.tokenizer, batch_size, run.max_batched_tokens, config.prefix_caching,
                    threaded=run.overlap, speculation=speculation(config, model_dir, llama, world_size, progress),
                    async_scheduling=config.async_scheduling)
    if config.compile:
        on_engine_thread(engine, functools.partial(runner.compile_decode, cpp_wrapper=True),
                         "compiled the decode step", progress)
    else:
        if runner.may_use_flex():  # its kernel compiled now, not in the first long step (a 13 s stall)
            on_engine_thread(engine, runner.warm_up, "compiled FlexAttention's kernel", progress)
        progress("not compiled (handler.compile: false)")
    return engine, run


def on_engine_thread(engine: Engine, compile_fn, done: str, progress):
    """Compile on the thread that will run the steps, and say how long it took."""
    start = time.perf_counter()
    engine.start(compile_fn)
    engine.wait()
    progress(done, seconds=round(time.perf_counter() - start, 1))


def speculation(config: ServingConfig, model_dir: str, llama, world_size: int, progress) -> Speculation | None:
    """handler.speculative's proposer, with the draft model loaded (sharded as the target is,
    its cache as many blocks as the target's: a sequence's block table addresses both)."""
    spec = config.speculative
    if spec.method == "off":
        return None
    runner = llama.runner
    if spec.method == "ngram":
        proposer = NgramProposer(spec.ngram_min, spec.ngram_max)
    else:
        path = os.path.join(model_dir, spec.draft)
        draft = tp_llama(None, path, llama.tokenizer.path, world_size, dtype=config.torch_dtype,
                         max_batch_size=runner.max_batch_size, max_seq_len=runner.max_seq_len,
                         progress=progress, quantization=config.quantization_mode, attention=config.attention)
        draft.runner.allocate(num_blocks=runner.num_blocks)
        if draft.runner.vocab_size != runner.vocab_size:
            raise ValueError(f"the draft model {path} has {draft.runner.vocab_size} tokens, the model "
                             f"{runner.vocab_size}: they must share the tokenizer")
        proposer = DraftProposer(draft.runner)
    logger.info("speculative decoding: %s, %d tokens per step, while at most %d sequences decode",
                spec.method, spec.k, spec.max_batch)
    return Speculation(proposer, spec.k, spec.max_batch, runner.max_seq_len)


class Progress:
    """Logs a stage of loading on this rank as tools/wait_ready.py reads it, e.g.
    'loading rank=1/2: weights loaded; bytes=8388608 seconds=0.4'. The bytes read so far
    go out at most every 2 s."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.reported = 0.0

    def __call__(self, stage: str, **figures):
        now = time.monotonic()
        if stage == "reading checkpoint" and "bytes" in figures and now - self.reported < 2:
            return
        self.reported = now
        text = " ".join(f"{k}={v}" for k, v in figures.items()).replace("\n", " ")
        logger.info("loading rank=%d/%d: %s%s", self.rank, self.world_size, stage, f"; {text}" if text else "")
