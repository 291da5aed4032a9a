"""A GGUF file's tokenizer, rebuilt for the `tokenizers` library from llama.cpp's metadata
(tokenizer.ggml.*), with what a Hugging Face folder's tokenizer_config.json would say (bos,
eos, pad, whether a text gets a BOS, the chat template). Two kinds, by `tokenizer.ggml.model`:

- gpt2: byte-level BPE from the tokens and merges, the text split as `tokenizer.ggml.pre` names;
- llama: sentencepiece BPE from the tokens and their scores, with byte fallback (<0xNN>).

Control and unknown tokens are special (never made from text, left out of decode); user-defined
ones are matched whole in text, as llama.cpp and transformers match them. Metadata that does not
add up is a ValueError that says what. tokenizer.py's GGUFTokenizer serves the result.
"""

from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4  # llama.cpp's token types (gguf.TokenType)
# llama.cpp (llama-vocab.cpp) ends a generation on these tokens, found by their text, besides eos,
# eot and eom
END_OF_GENERATION = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                     "<EOT>", "_<EOT>")
MAX_PIECE_CHARS = 1024  # a sentencepiece token is cut at each of its characters to find its merges
MISSING = object()


@dataclass(frozen=True)
class GGUFVocab:
    backend: Tokenizer  # encodes and decodes; special tokens added
    bos_id: int  # -1: none
    eos_id: int
    pad_id: int
    stop_ids: frozenset
    add_bos: bool  # a text gets a BOS (tokenizer.ggml.add_bos_token), and an EOS
    add_eos: bool
    config: dict  # bos_token, eos_token, unk_token, pad_token, as tokenizer_config.json gives them
    chat_template: str | None


def read(path: str) -> GGUFVocab:
    """The tokenizer of the GGUF file at path."""
    meta = read_metadata(path)
    kind = get(meta, "tokenizer.ggml.model", str)
    if kind not in BUILDERS:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: {', '.join(BUILDERS)})")
    tokens = get_list(meta, "tokenizer.ggml.tokens", str)
    n = len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    if n == 0 or len(vocab) != n:
        raise ValueError(f"the GGUF file's {n} tokens are not a vocabulary: none, or some more than once")
    types = get_list(meta, "tokenizer.ggml.token_type", int, n, default=[NORMAL] * n)
    backend = BUILDERS[kind](meta, vocab, types)
    add_special_tokens(backend, tokens, types)
    ids = {name: token_id(meta, name, n) for name in ("bos", "eos", "padding", "unknown", "eot", "eom")}
    stops = ({ids["eos"], ids["eot"], ids["eom"]} - {-1}) | {vocab[t] for t in END_OF_GENERATION if t in vocab}
    names = {"bos_token": ids["bos"], "eos_token": ids["eos"], "unk_token": ids["unknown"], "pad_token": ids["padding"]}
    return GGUFVocab(backend, ids["bos"], ids["eos"], ids["padding"], frozenset(stops),
                     # llama.cpp adds a BOS to a sentencepiece vocabulary that does not say
                     add_bos=get(meta, "tokenizer.ggml.add_bos_token", bool, default=kind == "llama"),
                     add_eos=get(meta, "tokenizer.ggml.add_eos_token", bool, default=False),
                     config={name: tokens[i] for name, i in names.items() if i >= 0},
                     chat_template=get(meta, "tokenizer.chat_template", str, default=None))


def read_metadata(path: str) -> dict:
    """The file's tokenizer.* metadata as Python values (arrays as lists)."""
    from gguf_checkpoint import Reader

    try:
        fields = Reader(path).fields  # memory-mapped; the tensors are not read
        return {key: field.contents() for key, field in fields.items() if key.startswith("tokenizer.")}
    except Exception as e:  # the reader's errors are those of whatever a broken file trips on
        raise ValueError(f"{path} is not a GGUF file that can be read: {type(e).__name__}: {e}") from None


def get(meta: dict, key: str, kind: type | tuple, default=MISSING):
    """meta[key] if it is a kind, default if absent (a ValueError without one)."""
    if key not in meta:
        if default is MISSING:
            raise ValueError(f"the GGUF file has no {key}")
        return default
    if not isinstance(meta[key], kind):
        raise ValueError(f"the GGUF file's {key} is not {type_names(kind)}: {str(meta[key])[:100]}")
    return meta[key]


def get_list(meta: dict, key: str, kind: type | tuple, n: int | None = None, default=MISSING) -> list:
    """meta[key] if it is a list of kinds (n of them if n is given), default if absent."""
    value = get(meta, key, list, default)
    if n is not None and len(value) != n:
        raise ValueError(f"the GGUF file's {key} has {len(value)} items for {n} tokens")
    if not all(isinstance(v, kind) for v in value):
        raise ValueError(f"the GGUF file's {key} is not a list of {type_names(kind)}")
    return value


def type_names(kind: type | tuple) -> str:
    return " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))


def token_id(meta: dict, name: str, n: int) -> int:
    """tokenizer.ggml.{name}_token_id, -1 if absent."""
    key = f"tokenizer.ggml.{name}_token_id"
    i = get(meta, key, int, default=-1)
    if not -1 <= i < n:
        raise ValueError(f"the GGUF file's {key} {i} is not one of its {n} tokens")
    return i


def bpe(**kwargs) -> Tokenizer:
    try:
        return Tokenizer(models.BPE(**kwargs))
    except Exception as e:  # tokenizers raises Exception: "Token `x` out of vocabulary", ...
        raise ValueError(f"the GGUF file's tokenizer does not add up: {e}") from None


def add_special_tokens(backend: Tokenizer, tokens: list[str], types: list[int]):
    """Control and unknown tokens as special tokens, user-defined ones as tokens matched whole
    in text; all of them already have their ids in the vocabulary."""
    special = [t for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)]
    user = [t for t, k in zip(tokens, types) if k == USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


# --- gpt2: byte-level BPE ---------------------------------------------------------------------

# Llama 3's split (tokenizer.LLAMA3_PATTERN, which this module cannot import)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def gpt2_split():
    """GPT-2's split ('s|'t|...| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+)."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def llama3_split():
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def smollm_split():
    """Each number character alone, then GPT-2's split: llama.cpp's "smollm" (\\p{N}, then
    GPT-2's regex), as SmolLM's tokenizer.json splits (Digits, then ByteLevel)."""
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2_split()])


# tokenizer.ggml.pre: (the split, whether a word that is a token skips the merges: llama.cpp's
# ignore_merges, which it sets for Llama 3)
PRE_TOKENIZERS = {"llama-bpe": (llama3_split, True), "smollm": (smollm_split, False), "gpt-2": (gpt2_split, False)}


def byte_level_bpe(meta: dict, vocab: dict[str, int], types: list[int]) -> Tokenizer:
    pre = get(meta, "tokenizer.ggml.pre", str, default="default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})")
    split, ignore_merges = PRE_TOKENIZERS[pre]
    merges = [parse_merge(m) for m in get_list(meta, "tokenizer.ggml.merges", str)]
    backend = bpe(vocab=vocab, merges=merges, ignore_merges=ignore_merges)
    backend.pre_tokenizer = split()
    backend.decoder = decoders.ByteLevel()
    return backend


def parse_merge(merge: str) -> tuple[str, str]:
    """"Ġ t" -> ("Ġ", "t") (byte-level tokens spell a space Ġ, so one space separates them)."""
    left, _, right = merge.partition(" ")
    if not left or not right or " " in right:
        raise ValueError(f"the GGUF file's merge {merge[:100]!r} is not two tokens")
    return left, right


# --- llama: sentencepiece BPE -----------------------------------------------------------------

def sentencepiece_bpe(meta: dict, vocab: dict[str, int], types: list[int]) -> Tokenizer:
    """As sentencepiece and llama.cpp encode: the text's spaces as ▁, and one ▁ before it where
    add_space_prefix says (the default), even before a space (transformers' Metaspace adds none
    there); merges by score; bytes (<0xNN>) for what no token spells."""
    scores = get_list(meta, "tokenizer.ggml.scores", (int, float), len(vocab))
    space = get(meta, "tokenizer.ggml.add_space_prefix", bool, default=True)
    unk = token_id(meta, "unknown", len(vocab))
    backend = bpe(vocab=vocab, merges=sentencepiece_merges(vocab, scores, types),
                  unk_token=list(vocab)[unk] if unk >= 0 else None, fuse_unk=True, byte_fallback=True)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁")] * space + [normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + [decoders.Strip(" ", 1, 0)] * space)
    return backend


def sentencepiece_merges(vocab: dict[str, int], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """The merges a sentencepiece BPE vocabulary implies: each normal token cut in two tokens,
    the best scored first (ties in vocabulary order). Control, byte and unused tokens are never
    merged into, as sentencepiece never makes them from text."""
    merges = []
    for token, score, kind in zip(vocab, scores, types):
        if kind != NORMAL:
            continue
        if len(token) > MAX_PIECE_CHARS:
            raise ValueError(f"the GGUF file's token {token[:20]!r}... is {len(token)} characters long")
        merges += [(score, token[:k], token[k:]) for k in range(1, len(token))
                   if token[:k] in vocab and token[k:] in vocab]
    merges.sort(key=lambda m: -m[0])
    return [(left, right) for _, left, right in merges]


BUILDERS = {"gpt2": byte_level_bpe, "llama": sentencepiece_bpe}
