"""The seed's face: ModelArgs, Transformer, tp_llama and Llama as Meta's reference names them.
The network is model.py, its sharding tp.py, the KV cache and compiling runner.py, the
loading checkpoint.py (quant.py quantizes as it loads); generate.py runs the engine."""

import contextlib
import dataclasses
import time

import torch
from torch import nn

import checkpoint
import collectives
import generate
import quant
import model
from model import (ARCHITECTURE_FIELDS, Attention, FeedForward, ModelArgs, RMSNorm, TransformerBlock, apply_rotary_emb,
                   precompute_freqs_cis, repeat_kv, to_empty)
from runner import ModelRunner
from tokenizer import Tokenizer
from tp import init_distributed, parallelize_llama_attn_block, weight_plan

__all__ = ["ModelArgs", "RMSNorm", "Attention", "FeedForward", "TransformerBlock", "Transformer", "Llama",
           "precompute_freqs_cis", "apply_rotary_emb", "repeat_kv", "tp_llama", "parallelize_llama_attn_block"]


class Transformer(model.Transformer):
    """The network (model.Transformer, which the runner drives with attention metadata) that
    can also be called as Meta's reference calls it: model(tokens, start_pos) -> logits
    (batch, seq, vocab), over a KV cache of its own in which row i of the batch is cache row
    i (runner.ModelRunner.__call__). tp_llama gives it the runner it serves with and its
    tokenizer, so that generate(model, ...) and text_completion(model, tokenizer, ...) take it
    as TorchServe's tp_llama example passes it; a bare one makes its runner when first called."""

    def __init__(self, params: ModelArgs):
        super().__init__(params)
        self._runner: ModelRunner | None = None
        self.tokenizer = None

    @property
    def runner(self) -> ModelRunner:
        """The runner that holds this model's KV cache: max_batch_size rows of max_seq_len
        tokens, on the weights' device (made again if the model has moved since)."""
        if self._runner is None or self._runner.device != self.tok_embeddings.weight.device:
            self._runner = ModelRunner(self, self.params.max_batch_size, self.params.max_seq_len)
        return self._runner

    @runner.setter
    def runner(self, runner: ModelRunner):
        self._runner = runner

    def forward(self, tokens: torch.Tensor, start_pos, attn_meta=None, logits_at: torch.Tensor | None = None):
        """The seed's call, forward(tokens (batch, seq), start_pos); or the runner's, whose second
        argument is every token's position (model.Transformer.forward)."""
        if attn_meta is None:
            return self.runner(tokens, start_pos)
        return super().forward(tokens, start_pos, attn_meta, logits_at)


def resolve_model_args(model_args: ModelArgs | None, checkpoint_args: dict, tokenizer: Tokenizer) -> ModelArgs:
    """The checkpoint's architecture, checked against model_args when given; model_args
    (or the checkpoint) sizes the KV cache."""
    ckpt = ModelArgs(**checkpoint_args)
    if ckpt.vocab_size <= 0:
        ckpt.vocab_size = tokenizer.n_words
    if model_args is None:
        return ckpt
    given = dataclasses.replace(model_args)
    if given.vocab_size <= 0:
        given.vocab_size = ckpt.vocab_size
    wrong = [f"{f}: given {getattr(given, f)}, checkpoint has {getattr(ckpt, f)}"
             for f in ARCHITECTURE_FIELDS if getattr(given, f) != getattr(ckpt, f)]
    if wrong:
        raise ValueError("model_args disagree with the checkpoint: " + "; ".join(wrong))
    return dataclasses.replace(ckpt, max_batch_size=given.max_batch_size, max_seq_len=given.max_seq_len)


def tp_llama(model_args, checkpoint_path, tokenizer_path, world_size, dtype: torch.dtype | None = None,
             max_batch_size: int | None = None, max_seq_len: int | None = None, kv_cache_bytes: int = 0,
             progress=None, quantization: str | None = None, attention: str = "auto", kv_cache_memory: float = 0.0):
    """Build a Llama sharded over world_size ranks from a Meta or Hugging Face checkpoint
    folder or a GGUF file (checkpoint.open_checkpoint). Each rank reads only its own slices of
    the (memory-mapped) checkpoint. tokenizer_path None: the checkpoint's own tokenizer.
    max_batch_size and max_seq_len, when given, size the KV cache instead of model_args;
    kv_cache_bytes, when given, is the KV cache's size on each rank instead, and
    kv_cache_memory (on a GPU) its share of the GPU memory left free after loading. progress,
    if given, is called as progress(stage, **figures) at each stage of loading. quantization:
    None, "int8" or "int4" (quant.py): each rank quantizes its shard as it loads it.
    attention: the runner's backend (runner.ATTENTION)."""
    report = progress or (lambda stage, **figures: None)
    device = init_distributed(world_size)
    report("reading checkpoint", path=checkpoint_path)
    tokenizer = Tokenizer(tokenizer_path or checkpoint_path)  # a file, or a folder that holds one
    reader = checkpoint.open_checkpoint(checkpoint_path)
    args = resolve_model_args(model_args, reader.model_args, tokenizer)
    if max_seq_len is None and model_args is None and args.max_position_embeddings:
        args.max_seq_len = min(args.max_seq_len, args.max_position_embeddings)  # the default, capped
    if args.vocab_size < tokenizer.n_words:
        raise ValueError(f"the tokenizer has {tokenizer.n_words} tokens, the model only {args.vocab_size}")
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(args, reader, world_size, device, dtype, quantization, report)
    if kv_cache_memory:
        kv_cache_bytes = free_memory_share(device, kv_cache_memory)
    runner = ModelRunner(model, max_batch_size or args.max_batch_size, max_seq_len or args.max_seq_len,
                         kv_cache_bytes=kv_cache_bytes, attention=attention)
    model.runner, model.tokenizer = runner, tokenizer
    report("kv cache allocated", bytes=runner.kv_cache_bytes())
    return Llama(model, tokenizer, runner)


def free_memory_share(device: torch.device, share: float) -> int:
    """share (0 to 1) of the memory left free on device's GPU (vLLM's gpu_memory_utilization,
    of what loading left)."""
    if device.type != "cuda":
        raise ValueError(f"kv_cache_memory is a share of a GPU's free memory; on {device.type} give kv_cache_bytes")
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * share)


@contextlib.contextmanager
def no_random_init():
    """nn.Linear's and nn.Embedding's random initialization skipped while the model is built on
    the meta device, where it computes nothing: its first call there imports torch._dynamo,
    0.6 s of CPU in every process that loads a model and never compiles (a TorchServe worker)."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def meta_shard(args: ModelArgs, world_size: int) -> Transformer:
    """This rank's shard of the model on the meta device, before any weight is read: the
    layers whose weights the weight plan names."""
    with torch.device("meta"), no_random_init():
        model = Transformer(args)
        parallelize_llama_attn_block(model, world_size)
    return model


def load_model(args: ModelArgs, reader, world_size: int, device: torch.device, dtype: torch.dtype,
               quantization: str | None, report) -> Transformer:
    """This rank's shard of the model, built on the meta device and filled from reader."""
    model = meta_shard(args, world_size).to(dtype)
    start = time.perf_counter()
    plan = weight_plan(model, collectives.tp_world()[0], world_size)

    def on_read(read: int):
        report("reading checkpoint", bytes=read)

    if quantization:
        read = quant.load_quantized(model, reader, plan, device, quantization, progress=on_read)
    else:
        model = to_empty(model, device)
        model.tie_weights()
        read = reader.load_into(model, plan, progress=on_read)
    quantized = {"quantization": quantization} if quantization else {}
    report("weights loaded", bytes=read, seconds=round(time.perf_counter() - start, 2), **quantized,
           dtype=str(dtype).removeprefix("torch."))
    return model.eval().requires_grad_(False)


class Llama:
    """A model, its tokenizer and the runner that holds its KV cache (by default, room for
    the model's max_batch_size rows of max_seq_len tokens); text_completion and
    chat_completion hand over to generate.py."""

    def __init__(self, model: Transformer, tokenizer, runner: ModelRunner | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.runner = runner or getattr(model, "runner", None) or ModelRunner(model, model.params.max_batch_size,
                                                                              model.params.max_seq_len)

    def text_completion(self, prompts: list[str], max_gen_len: int | None = None, **options) -> list[generate.CompletionPrediction]:
        return generate.text_completion(self, self.tokenizer, prompts, max_gen_len, **options)

    def chat_completion(self, dialogs: list[generate.Dialog], max_gen_len: int | None = None, **options) -> list[generate.ChatPrediction]:
        return generate.chat_completion(self, self.tokenizer, dialogs, max_gen_len, **options)
