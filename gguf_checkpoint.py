"""GGUF files (llama.cpp's format) as checkpoints: a Llama's architecture from the file's
metadata, and its weights read through gguf's GGUFReader (a memory map of the file) and
dequantized a slice at a time, so that a rank reads the blocks of its own shard only.

- Tensor names: token_embd, blk.N.attn_{q,k,v,output}, blk.N.ffn_{gate,up,down},
  blk.N.{attn,ffn}_norm, output_norm and output (absent: tied to token_embd). ggml lists a
  shape innermost first: attn_q's [dim, n_heads * head_dim] is Meta's wq, (out, in).
- Rotary layout: llama.cpp's converter permutes Hugging Face's q and k rows within each head
  (convert_hf_to_gguf.py's LlamaModel.permute: rotate-half pairs to interleaved ones), which
  is the inverse of Hugging Face's own conversion from Meta's layout: GGUF's q and k rows are
  in Meta's interleaved layout, model.rotate's, and are read as they are (tests/test_gguf.py
  checks it against transformers' logits).
- Llama 3's RoPE scaling is written as the tensor rope_freqs.weight (each frequency's
  divisor), with no metadata; it is read as Meta's scaling (META_ROPE_SCALING, the largest
  divisor its factor) when it is that, and refused otherwise.
- Weight types: TYPES, dequantized by gguf.quants.dequantize into the parameters' dtype. A
  row slice (column-parallel weights, a part of the vocabulary) is whole rows of blocks; a
  column slice (row-parallel wo and w2) is the blocks that cover it, dequantized and cut to
  its columns (K-quants' super-blocks are 256 wide: a slice need not be aligned to them).
"""

import math
import mmap
import re
import sys
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from model import META_ROPE_SCALING, llama3_scaled_freqs
from weight_files import CheckpointError
from weight_plan import Checkpoint, Piece, check_shape

Q = GGMLQuantizationType
TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
CHUNK_VALUES = 1 << 20  # dequantized at a time (4 MB in fp32): bounds the temporaries

# Meta's names (weight_plan.Piece) -> GGUF's
GLOBAL_NAMES = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                "output.weight": "output.weight"}
LAYER_NAMES = {"attention.wq": "attn_q", "attention.wk": "attn_k", "attention.wv": "attn_v",
               "attention.wo": "attn_output", "feed_forward.w1": "ffn_gate", "feed_forward.w2": "ffn_down",
               "feed_forward.w3": "ffn_up", "attention_norm": "attn_norm", "ffn_norm": "ffn_norm"}
ROPE_FREQS = "rope_freqs.weight"

# The llama.* metadata this model reads or checks; any other key is refused by name.
LLAMA_KEYS = {"block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
              "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
              "attention.key_length", "attention.value_length", "rope.freq_base", "rope.dimension_count",
              "rope.scaling.type", "expert_count", "expert_used_count"}


def gguf_name(name: str, tied: bool) -> str:
    """Meta name -> GGUF name."""
    if name == "output.weight" and tied:
        return "token_embd.weight"
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
    return f"blk.{m[1]}.{LAYER_NAMES[m[2]]}.weight"


class Reader(GGUFReader):
    """gguf 0.19.0's GGUFReader, which maps each tensor as it parses the tensor table, after
    checking that each tensor's type is one gguf knows and its bytes lie within the file: the
    reader's own errors for those (an enum lookup, a reshape of what a truncated file still
    holds) name no tensor."""

    def __init__(self, path: str):
        self.path = path
        super().__init__(path)

    def _build_fields(self, offs: int, count: int) -> int:
        """The metadata parsed from a plain array over the same map: each small view costs a
        fraction as much without np.memmap's own bookkeeping (SmolLM2's file: 0.25 s against
        0.5 s, with _get_field_parts)."""
        mapped, self.data = self.data, self.data.view(np.ndarray)
        try:
            return super()._build_fields(offs, count)
        finally:
            self.data = mapped

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple:
        """gguf's, with an array's items read in one pass: a vocabulary's tokens, merges and
        token types are hundreds of thousands of items, which gguf reads as two numpy views
        each (SmolLM2's file: 2.2 s by gguf's reading, in every process that opens it, for
        its tokenizer and again for its weights). An item is a 1-element array (a number) or
        a memoryview (a string's bytes), which ReaderField.contents reads as gguf's own."""
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":  # "S": the file's bytes swapped
            return super()._get_field_parts(orig_offs, raw_type)
        head = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
        item_type, count, offs = GGUFValueType(int(head[0][0])), int(head[1][0]), orig_offs + 12
        if item_type == GGUFValueType.STRING:
            data, items = memoryview(self.data), []
            for _ in range(count):
                n = int.from_bytes(data[offs:offs + 8], sys.byteorder)
                if offs + 8 + n > len(data):  # a count or length past the file: it is cut or corrupt
                    raise ValueError(f"array of {count} strings at byte {orig_offs} runs past the end of the file")
                items.append(data[offs + 8:offs + 8 + n])
                offs += 8 + n
        elif item_type in self.gguf_scalar_to_np:
            values = self._get(offs, self.gguf_scalar_to_np[item_type], count)
            if len(values) != count:
                raise ValueError(f"array of {count} numbers at byte {orig_offs} runs past the end of the file")
            items = list(values.reshape(-1, 1))
            offs += int(values.nbytes)
        else:  # arrays of arrays
            return super()._get_field_parts(orig_offs, raw_type)
        types = [GGUFValueType.ARRAY] + ([item_type] if count else [])
        return offs - orig_offs, head + items, list(range(2, 2 + count)), types

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts  # as GGUFReader._get_tensor_info_field lays them out
            name = bytes(name).decode(errors="replace")
            try:
                qtype = Q(int(raw_type[0]))
            except ValueError:
                raise CheckpointError(f"{self.path}: tensor {name} has type {int(raw_type[0])}, which gguf "
                                      f"does not know") from None
            block, size = GGML_QUANT_SIZES[qtype]
            end = start_offs + int(offset[0]) + math.prod(int(d) for d in dims) * size // block
            if end > len(self.data):
                raise CheckpointError(f"{self.path} is truncated or its tensor table corrupt: tensor {name} ends "
                                      f"at byte {end}, the file has {len(self.data)} bytes")
        super()._build_tensors(start_offs, fields)


def open_reader(path: str) -> Reader:
    try:
        return Reader(path)
    except CheckpointError:  # a ValueError, already named
        raise
    except (ValueError, KeyError, IndexError) as e:  # not GGUF, or a header cut short or corrupt
        raise CheckpointError(f"{path} is not a GGUF file that can be read ({type(e).__name__}: {e})") from None


def scalar(field, path: str):
    """A metadata value; a float32 as the decimal it was written from (1e-05, not
    9.999999747378752e-06, which would differ from the same model's config.json)."""
    if field.types[0] == GGUFValueType.ARRAY:
        raise CheckpointError(f"{path}: metadata {field.name} is an array (per layer), which this model does "
                              f"not implement")
    if field.types[0] == GGUFValueType.STRING:
        return field.contents()
    value = field.parts[-1][0]
    return float(str(value)) if isinstance(value, np.floating) else value.item()


def llama_args(reader: Reader, path: str) -> dict:
    """ModelArgs keyword arguments from the file's metadata (llama.*) and tensor table."""
    def refuse(what):
        raise CheckpointError(f"{path}: {what} is not implemented by this model")

    fields = reader.fields

    def get(key: str, default=...):
        if key in fields:
            return scalar(fields[key], path)
        if default is ...:
            raise CheckpointError(f"{path}: metadata {key} is missing")
        return default

    arch = get("general.architecture")
    if arch != "llama":
        refuse(f"architecture {arch!r}")
    if get("split.count", 1) > 1:
        refuse(f"a GGUF split into {get('split.count')} files (merge them with llama-gguf-split --merge)")
    unknown = sorted(key for key in fields if key.startswith("llama.") and key.removeprefix("llama.") not in LLAMA_KEYS)
    if unknown:
        refuse(f"metadata {unknown}")
    dim, n_heads = get("llama.embedding_length"), get("llama.attention.head_count")
    head_dim = dim // n_heads
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        if get(f"llama.{key}", head_dim) != head_dim:
            refuse(f"llama.{key} {get(f'llama.{key}')} (not embedding_length / head_count = {head_dim})")
    if get("llama.expert_count", 0):
        refuse(f"llama.expert_count {get('llama.expert_count')} (a mixture of experts)")
    if get("llama.rope.scaling.type", "none") != "none":
        refuse(f"rope scaling of type {get('llama.rope.scaling.type')!r}")
    theta = get("llama.rope.freq_base", 10000.0)
    tensors = {t.name: t for t in reader.tensors}
    rope_freqs = tensors.get(ROPE_FREQS)
    tokens = fields.get("tokenizer.ggml.tokens")
    return {"dim": dim, "n_layers": get("llama.block_count"), "n_heads": n_heads,
            "n_kv_heads": get("llama.attention.head_count_kv", n_heads),
            "vocab_size": get("llama.vocab_size", len(tokens.data) if tokens else -1),
            "intermediate_size": get("llama.feed_forward_length"),
            "norm_eps": get("llama.attention.layer_norm_rms_epsilon"), "rope_theta": theta,
            "rope_scaling": llama3_scaling(rope_freqs, theta, head_dim, path) if rope_freqs is not None else None,
            "max_position_embeddings": get("llama.context_length", None),
            "tie_word_embeddings": "output.weight" not in tensors}


def llama3_scaling(t, theta: float, head_dim: int, path: str) -> dict:
    """Meta's Llama 3 scaling from rope_freqs.weight, each frequency's divisor as llama.cpp's
    converter computes it (LlamaModel.generate_extra_tensors), if that is what it holds."""
    if t.tensor_type != Q.F32 or t.n_elements != head_dim // 2:
        raise CheckpointError(f"{path}: {ROPE_FREQS} is {t.tensor_type.name} of {t.n_elements} values, "
                              f"not F32 of {head_dim // 2} (one per frequency)")
    divisors = torch.from_numpy(np.array(t.data, dtype=np.float32))
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    # The lowest frequency's divisor gives the factor: 1 / divisor = (1 - s) / factor + s,
    # s its blend between dividing by the factor (0: wavelengths beyond context /
    # low_freq_factor, Llama 3's own) and leaving it (1: none is scaled, nor need be)
    c = META_ROPE_SCALING
    wavelen = 2 * math.pi / freqs[-1].item()
    s = (c["original_max_position_embeddings"] / wavelen - c["low_freq_factor"]) / \
        (c["high_freq_factor"] - c["low_freq_factor"])
    s = min(max(s, 0.0), 1.0)
    factor = round((1 - s) / (1 / divisors[-1].item() - s), 4) if s < 1 else 1.0
    scaling = c | {"factor": factor}
    if not torch.allclose(divisors, freqs / llama3_scaled_freqs(freqs, **scaling), rtol=1e-4):
        raise CheckpointError(f"{path}: {ROPE_FREQS} holds RoPE divisors that are not Llama 3's scaling with "
                              f"Meta's constants {scaling}, the only RoPE scaling of a GGUF file this model "
                              f"implements")
    return scaling


def check_tensor_table(reader: Reader, n_layers: int, path: str):
    """Every tensor is one of the model's, of a type this reader dequantizes; none is missing."""
    required = {"token_embd.weight", "output_norm.weight"} | \
        {f"blk.{i}.{part}.weight" for i in range(n_layers) for part in LAYER_NAMES.values()}
    optional = {"output.weight", ROPE_FREQS}
    for t in reader.tensors:
        if t.name not in required | optional:
            raise CheckpointError(f"{path}: tensor {t.name} is not implemented by this model")
        if t.tensor_type not in TYPES:
            raise CheckpointError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which this model "
                                  f"does not read (it reads {', '.join(q.name for q in TYPES)})")
    missing = sorted(required - {t.name for t in reader.tensors})
    if missing:
        raise CheckpointError(f"{path}: tensors {missing} are missing")


def inspect(path: str) -> tuple[dict, int | None]:
    """(model arguments, the context length it was made for) of the GGUF file at path, after
    checking its header and tensor table; reads no weights (rope_freqs.weight's few values)."""
    args = GGUFCheckpoint(path).model_args
    return args, args["max_position_embeddings"]


class Blocks(NamedTuple):
    """The ggml blocks that hold a piece: data, (rows, bytes) viewing the file; their type; and
    the piece's columns within the rows they dequantize to: [skip, skip + width)."""
    data: np.ndarray
    qtype: GGMLQuantizationType
    skip: int
    width: int


class GGUFCheckpoint(Checkpoint):
    def __init__(self, path: str):
        self.path = path
        # The reader is not kept: its parsed metadata, an object per token and merge (100 MB
        # for SmolLM2's 49,152 tokens), goes with it; the tensors keep the file's map.
        reader = open_reader(path)
        self.model_args = llama_args(reader, path)
        check_tensor_table(reader, self.model_args["n_layers"], path)
        self.tensors = {t.name: t for t in reader.tensors}
        self.file = reader.data  # the np.memmap they view
        self.tied = self.model_args["tie_word_embeddings"]

    def blocks(self, piece: Piece) -> Blocks:
        """The blocks of piece's rows, or of the columns it spans, as they are in the file."""
        name = gguf_name(piece.name, self.tied)
        t = self.tensors[name]  # check_tensor_table: all there
        check_shape(piece, tuple(reversed(t.shape.tolist())), f"{self.path} ({name})")
        data = t.data.reshape(-1, t.data.shape[-1]).view(np.uint8)  # a 1-D tensor is one row
        if piece.dim == 0:
            data = data[piece.start:piece.end]
        if piece.dim != 1:
            return Blocks(data, t.tensor_type, 0, int(t.shape[0]))
        block, size = GGML_QUANT_SIZES[t.tensor_type]
        first, last = piece.start // block, -(-piece.end // block)
        return Blocks(data[:, first * size:last * size], t.tensor_type, piece.start - first * block,
                      piece.end - piece.start)

    def read_into(self, piece: Piece, out: torch.Tensor) -> int:
        """Dequantize piece's blocks into out a chunk of rows at a time, releasing each chunk's
        pages of the file once read."""
        blocks = self.blocks(piece)
        rows = out.view(-1, blocks.width)
        block, size = GGML_QUANT_SIZES[blocks.qtype]
        step = max(1, CHUNK_VALUES // (blocks.data.shape[1] // size * block))
        for r in range(0, len(rows), step):
            chunk = blocks.data[r:r + step]
            values = dequantize(chunk, blocks.qtype)[:, blocks.skip:blocks.skip + blocks.width]
            # F32 comes back as a read-only view of the file, which torch.from_numpy warns about
            rows[r:r + step].copy_(torch.from_numpy(np.require(values, requirements="W")))
            self.release(chunk)
        return blocks.data.nbytes

    def release(self, data: np.ndarray):
        """Unmap the file's pages under data from this process (MADV_DONTNEED; they are clean
        pages of a read-only map, which stay in the page cache and are read again if touched):
        a rank's resident memory is then its shard, not also every page of the file it read."""
        start = data.ctypes.data - self.file.ctypes.data
        end = start + (len(data) - 1) * data.strides[0] + data.shape[1]
        start -= start % mmap.PAGESIZE
        self.file.base.madvise(mmap.MADV_DONTNEED, start, end - start)  # base: the np.memmap's mmap.mmap
