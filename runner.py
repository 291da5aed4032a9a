"""The model runner: runs a Transformer over the paged KV cache. It owns the cache (one pool
of blocks per layer, attached to each Attention), turns the engine's Batch into the
network's inputs and attention metadata (attention.py, the one place an attention backend
plugs in), compiles the decode step and captures and replays its CUDA graphs."""

import weakref

import torch

import collectives
from attention import GatherAttention
from batch import Batch, to_device
from flex_attention import FlexAttention, floats_as_constants
from model import Transformer

KV_BLOCK_SIZE = 16  # tokens per KV-cache block
# How a step attends (attention.py, flex_attention.py): gathering each sequence's blocks for
# scaled_dot_product_attention (sdpa), FlexAttention reading them in place (flex), or auto:
# flex for a step that would gather at least FLEX_FROM_TOKENS cached tokens, where it
# measured faster on CPU, and sdpa below, where its fixed cost per call loses (BENCHMARKS.md,
# attention backends). Only for a model whose every query head has its own KV heads: with
# grouped-query heads flex measured even with sdpa at 2 query heads per KV head and slower at
# 3 or 4, on CPU (docs/tuning-log.md).
# Auto on CUDA is sdpa until bench/gpu_check.sh has measured flex there.
ATTENTION = ("auto", "flex", "sdpa")
FLEX_FROM_TOKENS = 2048
# The runner whose graphs torch.compile holds: they are cached on Transformer.forward's code,
# which every model in the process shares, and compile_decode skips the guards on modules
# that would tell two models apart.
compiled_runner: weakref.ref | None = None


class ModelRunner:
    def __init__(self, model: Transformer, max_batch_size: int, max_seq_len: int, num_blocks: int | None = None,
                 kv_cache_bytes: int = 0, attention: str = "auto"):
        """model: loaded, on its device. The cache holds num_blocks blocks of block_size tokens
        per layer, or as many as kv_cache_bytes holds on this rank, or by default enough for
        max_batch_size rows of max_seq_len tokens (what __call__ addresses as rows).
        attention: the backend, one of ATTENTION."""
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
        self.model = model
        self.attention = attention
        weight = model.tok_embeddings.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.block_size = KV_BLOCK_SIZE
        self.compiled_decode = None  # set by compile_decode
        self.decode_buckets: tuple[list[int], list[int]] | None = None  # compile_decode(cuda_graphs=True)
        self.allocate(max_batch_size, max_seq_len, num_blocks or kv_cache_bytes // self.kv_block_bytes() or None)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def allocate(self, max_batch_size: int | None = None, max_seq_len: int | None = None,
                 num_blocks: int | None = None):
        """(Re)allocate the rotary table and the KV cache; arguments not given keep their value
        (num_blocks: the default for the sizes)."""
        self.max_batch_size = max_batch_size or self.max_batch_size
        self.max_seq_len = max_seq_len or self.max_seq_len
        limit = self.model.params.max_position_embeddings
        if limit and self.max_seq_len > limit:
            raise ValueError(f"max_seq_len {self.max_seq_len} exceeds the {limit} positions "
                             "the model was trained for (max_position_embeddings)")
        self.model.setup_rope(self.max_seq_len)
        self.row_blocks = -(-self.max_seq_len // self.block_size)  # blocks of one row of __call__
        self.num_blocks = num_blocks or self.max_batch_size * self.row_blocks
        if self.num_blocks < self.row_blocks:
            raise ValueError(f"a KV cache of {self.num_blocks} blocks of {self.block_size} tokens cannot hold one "
                             f"sequence of max_seq_len {self.max_seq_len}")
        self.attach_cache(self.num_blocks)

    def attach_cache(self, num_blocks: int):
        """A zeroed cache of num_blocks blocks for every layer's attention, on this rank's heads."""
        for layer in self.model.layers:
            attn = layer.attention
            shape = (attn.n_local_kv_heads, num_blocks, self.block_size, attn.head_dim)
            attn.cache_k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.cache_v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.pool_blocks = num_blocks

    def kv_block_bytes(self) -> int:
        """Bytes of one KV-cache block on this rank, all layers (in the weights' dtype)."""
        attn = self.model.layers[0].attention
        return (2 * self.model.n_layers * attn.n_local_kv_heads * self.block_size * attn.head_dim
                * self.dtype.itemsize)

    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.kv_block_bytes()

    @torch.inference_mode()
    def forward_batch(self, batch: Batch) -> torch.Tensor:
        """Logits (len(logits_at), vocab) of one pass over the sequences of batch."""
        if self.decode_buckets is not None and not batch.chunks and batch.n_decode <= self.decode_buckets[0][-1]:
            return self.bucketed_decode(batch)
        logits_at = None if batch.logits_at is None else to_device(batch.logits_at, self.device, torch.long)
        run = self.compiled_decode if self.compiled_decode is not None and not batch.chunks else self.model
        return run(*self.model_inputs(batch), logits_at)

    def model_inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, GatherAttention | FlexAttention]:
        positions = to_device(batch.positions, self.device)
        return batch.token_ids(self.device), positions, self.attention_metadata(batch, positions)

    def attention_metadata(self, batch: Batch, positions: torch.Tensor) -> GatherAttention | FlexAttention:
        """batch's attention metadata, for the backend that self.attention picks for it."""
        flex = self.attention == "flex"
        if self.attention == "auto" and self.flex_may_pay():
            cached = [blocks for _, blocks, first in batch.chunks if first > 0]
            flex = sum(map(len, batch.decode_blocks + cached)) * self.block_size >= FLEX_FROM_TOKENS
        if flex:
            return FlexAttention.build(batch, positions, self.block_size, self.pool_blocks)
        return GatherAttention.build(batch, positions, self.block_size, self.dtype)

    def flex_may_pay(self) -> bool:
        """Whether auto considers flex here: on CPU (measured there only so far), for a model
        without grouped-query heads, with a pool of at least FLEX_FROM_TOKENS tokens (a smaller
        one reaches them only through a prefix that several sequences share). Elsewhere auto
        stays with sdpa and compiles no flex kernel or graph."""
        params = self.model.params
        return (self.device.type != "cuda" and params.n_kv_heads == params.n_heads
                and self.num_blocks * self.block_size >= FLEX_FROM_TOKENS)

    def may_use_flex(self) -> bool:
        """Whether a step may attend with FlexAttention, which is compiled at its first use
        (13 s here, eager or not): warm_up compiles it when the worker loads."""
        return self.attention == "flex" or (self.attention == "auto" and self.flex_may_pay())

    @torch.inference_mode()
    def bucketed_decode(self, batch: Batch, rows: int | None = None, width: int | None = None,
                        padding_position: int = 0):
        """A decode-only batch in the fixed shapes of a CUDA graph: the rows padded up to the
        next rows bucket, each block table padded (block 0, masked off) to the next blocks
        bucket (or to rows and width blocks), logits for every row, logits_at picked
        afterwards. A padding row reads and writes only the scratch block."""
        n, size = batch.n_decode, self.block_size
        rows = rows or next(b for b in self.decode_buckets[0] if b >= n)
        width = width or next(w for w in self.decode_buckets[1] if w >= max(map(len, batch.decode_blocks)))
        pad, scratch = rows - n, self.num_blocks  # the block past the pool's (compile_decode)
        tables = [b + [0] * (width - len(b)) for b in batch.decode_blocks] + [[scratch] * width] * pad
        padded = Batch(tokens=batch.tokens + [0] * pad, positions=batch.positions + [padding_position] * pad,
                       slots=batch.slots + [scratch * size] * pad, n_decode=rows, decode_blocks=tables,
                       carried=batch.carried, carried_from=batch.carried_from)
        inputs = self.model_inputs(padded)
        torch.compiler.cudagraph_mark_step_begin()  # the last replay's outputs may be overwritten now
        logits = self.compiled_decode(*inputs, None)
        wanted = to_device(list(range(n) if batch.logits_at is None else batch.logits_at), logits.device, torch.long)
        return logits[wanted]  # a copy: the graph's output buffer is overwritten by its next replay

    def compile_decode(self, cuda_graphs: bool = False, cpp_wrapper: bool = False, **options):
        """torch.compile the decode step (one token for each of several sequences), which
        removes most of the per-operation overhead, and compile it now rather than in the
        first requests. Shapes are dynamic, so that growing block tables do not recompile;
        one row and several rows compile a graph each (a table of one block is padded to two).
        Meant for one model per process: the graphs of a model compiled before this one are
        dropped and that model runs eager from then on (with the guards on modules skipped,
        they would run on this one's modules: KeyError on a weight one has and the other not).

        cuda_graphs: also replay each decode step from a CUDA graph (mode "reduce-overhead"),
        so that a GPU step costs its weights' bytes rather than hundreds of kernel launches.
        A graph has fixed shapes and addresses: decode steps run padded (bucketed_decode), one
        graph per (rows bucket, blocks bucket), all captured here, and the caches stay where
        they are, with one more block for padding rows to write (they are allocated again
        here: call it before serving). Off CUDA the same padded steps run compiled, without
        graphs (the CPU dry run).

        cpp_wrapper (CPU, without cuda_graphs): the graphs call their kernels from C++
        (inductor's cpp_wrapper) instead of Python. A one-row step of SmolLM2 measured ~12 %
        faster, but a first compile (nothing in inductor's cache) took twice as long
        (docs/tuning-log.md): the server asks for it, the tests' small models need not."""
        if cuda_graphs:  # a scratch block past those the pool hands out
            self.attach_cache(self.num_blocks + 1)
            options.setdefault("mode", "reduce-overhead")
        else:  # (torch.compile takes a mode or options, not both)
            # No guards on the model's modules: nothing replaces a weight, cache or attribute
            # after this, and checking them took 0.64 ms of a one-row SmolLM2 step (0.07 without)
            options.setdefault("options", {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                                           "cpp_wrapper": cpp_wrapper and self.device.type == "cpu"})
        global compiled_runner
        earlier = compiled_runner and compiled_runner()
        if earlier is not None and earlier is not self:
            earlier.compiled_decode = earlier.decode_buckets = None
        torch._dynamo.reset()
        compiled_runner = weakref.ref(self)
        collectives.ops_in_graphs()
        floats_as_constants()
        for layer in self.model.layers:  # only the activations' sizes vary, not the caches'
            for cache in (layer.attention.cache_k, layer.attention.cache_v):
                torch._dynamo.mark_static(cache)
                if cuda_graphs:  # written in place by the graphs: an input copied in would be lost
                    torch._dynamo.mark_static_address(cache)
        self.compiled_decode = torch.compile(self.model, dynamic=True, **options)
        if cuda_graphs:
            self.capture_graphs()
        else:
            self.warm_up()

    def capture_graphs(self):
        self.decode_buckets = (buckets(self.max_batch_size, 1), buckets(self.row_blocks, 4))
        nothing = Batch(tokens=[], positions=[], slots=[])
        for width in self.decode_buckets[1]:
            position = min(width * self.block_size, self.max_seq_len) - 1
            for rows in self.decode_buckets[0]:  # rows of padding only: the scratch block gets junk
                for _ in range(3):  # cudagraph trees: a warm-up run, the capture, a replay
                    self.bucketed_decode(nothing, rows, width, position)

    def warm_up(self):
        """A prefill (eager), then compiled decode steps of each kind, with each backend that
        auto may pick, flex first: its first graph compiled for several rows after sdpa's,
        inductor's CPU flex template failed to compile (torch 2.13). The rows take the pool's
        first blocks (they get junk), two each: a cache that holds one max_seq_len still
        compiles the several-rows graph, which a first step of two sequences compiled instead
        (15 s of DEMO's first request here, holding every stream)."""
        length = min(self.block_size + 2, self.max_seq_len - 1)
        per_row = -(-(length + 1) // self.block_size)
        rows = min(2, self.max_batch_size, self.num_blocks // per_row)
        tables = [list(range(row * per_row, (row + 1) * per_row)) for row in range(rows)]

        def step(*parts):  # (row, tokens, position of the first, decode) each
            batch = Batch(tokens=[], positions=[], slots=[])
            for row, n, start, decode in parts:
                batch.add([0] * n, start, tables[row], self.block_size, decode=decode)
            self.forward_batch(batch)

        chosen = self.attention
        for self.attention in ("flex", "sdpa") if chosen == "auto" and self.flex_may_pay() else (chosen,):
            step(*[(row, length, 0, False) for row in range(rows)])
            step((0, 2, length - 2, False))  # a chunk after cached tokens
            for pos in (1, length):
                step((0, 1, pos, True))
                if rows > 1:
                    step((0, 1, pos, True), (1, 1, pos - 1, True))
        self.attention = chosen

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, start_pos, slot: int = 0) -> torch.Tensor:
        """Logits (batch, seq, vocab) for tokens (batch, seq) whose first token sits at
        start_pos: one int for all rows, or a list with each row's own position. Row i's
        keys and values live in the blocks of cache row slot + i (the KV cache seen as
        max_batch_size rows of max_seq_len tokens, as in Meta's reference)."""
        bsz, seqlen = tokens.shape
        starts = [start_pos] * bsz if isinstance(start_pos, int) else list(start_pos)
        end = max(starts) + seqlen
        if (slot + bsz) * self.row_blocks > self.num_blocks or end > self.max_seq_len:
            raise ValueError(f"cache rows {slot + bsz} x length {end} exceed the KV cache "
                             f"({self.num_blocks // self.row_blocks} x {self.max_seq_len})")
        batch = Batch(tokens=[], positions=[], slots=[])
        for row, (start, row_tokens) in enumerate(zip(starts, tokens.tolist())):
            first = (slot + row) * self.row_blocks
            table = list(range(first, first + -(-(start + seqlen) // self.block_size)))
            batch.add(row_tokens, start, table, self.block_size, decode=seqlen == 1)
        return self.forward_batch(batch).view(bsz, seqlen, -1)


def buckets(limit: int, first: int) -> list[int]:
    """Powers of two from first up to limit, and limit itself: the sizes graphs are captured for."""
    sizes = [first]
    while sizes[-1] * 2 < limit:
        sizes.append(sizes[-1] * 2)
    return [n for n in sizes if n < limit] + [limit]
