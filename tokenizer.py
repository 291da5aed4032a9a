"""Tokenizers with the interface of Meta's reference code (encode(s, bos, eos), decode,
bos_id, eos_id, pad_id, n_words) and stop_ids, over three backends, picked by looking at
the file rather than its name:

- a sentencepiece model: Llama 2, CodeLlama;
- Meta's Llama 3 tokenizer.model (tiktoken BPE ranks, one "base64 rank" line each);
- Hugging Face's tokenizer.json, through the `tokenizers` library;
- a GGUF file's tokenizer metadata (llama.cpp's), rebuilt by gguf_vocab.py for `tokenizers`.

Text given to encode() is always plain text: "<|eot_id|>" typed by a user encodes as the
characters it is made of, never as the special token (Meta's behaviour). decode() leaves
special tokens out; TextStream turns tokens into text a piece at a time, exactly.
"""

import base64
import json
import os
import re

TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+=* \d+\r?\n")


def read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def tokenizer_file(path: str) -> str:
    """The tokenizer file that path names: itself, or in a folder tokenizer.json (Hugging
    Face), else tokenizer.model (Meta)."""
    if os.path.isdir(path):
        for name in ("tokenizer.json", "tokenizer.model"):
            if os.path.isfile(os.path.join(path, name)):
                return os.path.join(path, name)
        raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {path}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer not found: {path}")
    return path


def backend(path: str) -> type:
    """The Tokenizer class for a tokenizer file, from its first bytes."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith(b"GGUF"):
        return GGUFTokenizer
    if head.lstrip().startswith(b"{"):
        return HFTokenizer
    if TIKTOKEN_LINE.match(head):
        return TiktokenTokenizer
    return SentencePieceTokenizer


class Tokenizer:
    """Tokenizer(path) returns the backend that fits the file (or the folder) at path.

    Attributes: n_words, bos_id, eos_id, pad_id (-1: none), stop_ids (every id that ends a
    generation), special_tokens ({text: id} of the tokens that plain text never yields),
    config (tokenizer_config.json beside the file, {} without one), chat_template (None
    without one)."""

    n_words: int
    bos_id: int
    eos_id: int
    pad_id: int
    stop_ids: frozenset
    special_tokens: dict

    def __new__(cls, model_path: str | None = None):
        if cls is Tokenizer:
            cls = backend(tokenizer_file(model_path))
        return super().__new__(cls)

    def __init__(self, model_path: str):
        self.path = tokenizer_file(model_path)
        folder = os.path.dirname(os.path.abspath(self.path))
        self.config = read_json(os.path.join(folder, "tokenizer_config.json"))
        self.chat_template = read_chat_template(folder, self.config)

    def encode(self, s: str, bos: bool, eos: bool) -> list[int]:
        if not isinstance(s, str):
            raise TypeError(f"can only encode str, got {type(s).__name__}")
        bos, eos = bos and self.bos_id >= 0, eos and self.eos_id >= 0  # a tokenizer may have neither
        return [self.bos_id] * bos + self.encode_text(s) + [self.eos_id] * eos

    def encode_text(self, s: str) -> list[int]:
        raise NotImplementedError

    def decode(self, t: list[int]) -> str:
        """The text of t, special tokens left out; an incomplete character is U+FFFD."""
        raise NotImplementedError

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (a special token: its text), for logprobs."""
        raise NotImplementedError

    def token_str(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")


def read_chat_template(folder: str, config: dict) -> str | None:
    """The checkpoint's chat template: tokenizer_config.json's chat_template (a string, or
    named templates of which "default" is used), or chat_template.jinja (transformers 5)."""
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    path = os.path.join(folder, "chat_template.jinja")
    if template is None and os.path.isfile(path):
        with open(path) as f:
            template = f.read()
    return template


# --- sentencepiece: Llama 2, CodeLlama ---------------------------------------------------

class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model_path: str):
        super().__init__(model_path)
        from sentencepiece import SentencePieceProcessor

        self.sp_model = SentencePieceProcessor(model_file=self.path)
        self.n_words = self.sp_model.vocab_size()
        self.bos_id = self.sp_model.bos_id()
        self.eos_id = self.sp_model.eos_id()
        self.pad_id = self.sp_model.pad_id()
        self.stop_ids = frozenset([self.eos_id])
        self.special_tokens = {self.sp_model.id_to_piece(i): i for i in range(self.n_words)
                               if self.sp_model.is_control(i)}

    def encode_text(self, s: str) -> list[int]:
        return self.sp_model.encode(s)  # sentencepiece never parses control tokens out of text

    def decode(self, t: list[int]) -> str:
        return self.sp_model.decode(list(t))

    def token_bytes(self, token: int) -> bytes:
        piece = self.sp_model.id_to_piece(token)
        if self.sp_model.is_byte(token):  # "<0x0A>"
            return bytes([int(piece[1:-1], 16)])
        return piece.replace("\u2581", " ").encode()


# --- Meta's Llama 3 tokenizer.model, through tiktoken --------------------------------------

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_NAMED_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                         "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                         "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
                         "<|image|>"]
LLAMA3_N_SPECIALS = 256
TIKTOKEN_MAX_CHARS = 400_000  # tiktoken panics on longer inputs, and on longer runs below
TIKTOKEN_MAX_RUN = 25_000  # of whitespace or non-whitespace (tiktoken issue 195)


def llama3_special_tokens() -> list[str]:
    """Meta's 256 special tokens in id order (llama-models' names: the 3.1+ ones where 3.0
    had reserved tokens; the ids, and so the encoding, are the same in both)."""
    n_reserved = LLAMA3_N_SPECIALS - len(LLAMA3_NAMED_SPECIALS)
    return LLAMA3_NAMED_SPECIALS + [f"<|reserved_special_token_{2 + i}|>" for i in range(n_reserved)]


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    with open(path, "rb") as f:
        return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in f if line.strip())}


def write_tiktoken_ranks(ranks: dict[bytes, int], path: str):
    """Meta's tokenizer.model format (for tests and tools)."""
    with open(path, "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")


class TiktokenTokenizer(Tokenizer):
    def __init__(self, model_path: str):
        super().__init__(model_path)
        import tiktoken

        ranks = read_tiktoken_ranks(self.path)
        n_base = len(ranks)
        self.special_tokens = {t: n_base + i for i, t in enumerate(llama3_special_tokens())}
        self.model = tiktoken.Encoding(os.path.basename(self.path), pat_str=LLAMA3_PATTERN,
                                       mergeable_ranks=ranks, special_tokens=self.special_tokens)
        self.n_base = n_base
        self.n_words = n_base + len(self.special_tokens)
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]
        self.pad_id = self.special_tokens["<|finetune_right_pad_id|>"]
        self.stop_ids = frozenset(self.special_tokens[t] for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"))
        self.special_text = {i: t for t, i in self.special_tokens.items()}

    def encode_text(self, s: str) -> list[int]:
        out = []
        for i in range(0, len(s), TIKTOKEN_MAX_CHARS):
            for part in split_long_runs(s[i:i + TIKTOKEN_MAX_CHARS], TIKTOKEN_MAX_RUN):
                out += self.model.encode(part, allowed_special=set(), disallowed_special=())
        return out

    def decode(self, t: list[int]) -> str:
        return self.model.decode_bytes([i for i in t if i < self.n_base]).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        if token in self.special_text:
            return self.special_text[token].encode()
        return self.model.decode_single_token_bytes(token)


def split_long_runs(s: str, limit: int):
    """s in pieces with no run of more than limit whitespace or non-whitespace characters."""
    start, run, space = 0, 0, s[:1].isspace()
    for i, c in enumerate(s):
        if c.isspace() != space:
            run, space = 1, c.isspace()
        else:
            run += 1
            if run > limit:
                yield s[start:i]
                start, run = i, 1
    yield s[start:]


# --- Hugging Face tokenizer.json ------------------------------------------------------------

def token_content(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def as_ids(value) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


class HFTokenizer(Tokenizer):
    """tokenizer.json; bos, eos, pad and the stop ids from tokenizer_config.json,
    generation_config.json and config.json beside it (eos_token_id may be a list). A text
    gets BOS (EOS) where transformers' tokenizer(s).input_ids would: where tokenizer.json's
    post-processor adds it (SmolLM2's adds none, Llama 3's <|begin_of_text|>; transformers 5
    reads no add_bos_token beside such a tokenizer.json)."""

    def __init__(self, model_path: str):
        super().__init__(model_path)
        from tokenizers import Tokenizer as HFBackend

        self.use_backend(HFBackend.from_file(self.path))
        folder = os.path.dirname(os.path.abspath(self.path))
        generation = read_json(os.path.join(folder, "generation_config.json"))
        model_config = read_json(os.path.join(folder, "config.json"))

        def config_id(name: str) -> int | None:
            content = token_content(self.config.get(f"{name}_token"))
            if content is not None:
                return self.model.token_to_id(content)
            ids = as_ids(generation.get(f"{name}_token_id", model_config.get(f"{name}_token_id")))
            return ids[0] if ids else None

        bos, eos, pad = config_id("bos"), config_id("eos"), config_id("pad")
        self.bos_id = -1 if bos is None else bos
        self.eos_id = -1 if eos is None else eos
        self.pad_id = -1 if pad is None else pad
        stops = set(as_ids(generation.get("eos_token_id"))) | set(as_ids(model_config.get("eos_token_id")))
        self.stop_ids = frozenset(stops | ({self.eos_id} if eos is not None else set()))
        added = self.model.encode("a", add_special_tokens=True).ids
        self.add_bos, self.add_eos = added[:1] == [self.bos_id], added[-1:] == [self.eos_id]

    def encode(self, s: str, bos: bool, eos: bool) -> list[int]:
        """bos: a text prompt's BOS, where the tokenizer adds one (and its EOS, where it adds
        that); eos: an EOS whatever the tokenizer adds."""
        return super().encode(s, bos and self.add_bos, eos or (bos and self.add_eos))

    def use_backend(self, model):
        """model (a tokenizers.Tokenizer) encodes and decodes: its special tokens, its size and
        whether it spells bytes as GPT-2's byte-level BPE does."""
        self.model = model
        self.model.encode_special_tokens = True  # special-token text in the input stays text
        added = self.model.get_added_tokens_decoder()
        self.special_tokens = {t.content: i for i, t in added.items() if t.special}
        self.special_ids = frozenset(self.special_tokens.values())
        self.n_words = self.model.get_vocab_size(with_added_tokens=True)
        self.byte_level = "ByteLevel" in json.dumps(json.loads(self.model.to_str()).get("decoder"))
        self.byte_decoder = {c: b for b, c in bytes_to_unicode().items()}

    def encode_text(self, s: str) -> list[int]:
        return self.model.encode(s, add_special_tokens=False).ids

    def decode(self, t: list[int]) -> str:
        return self.model.decode(list(t), skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        piece = self.model.id_to_token(token)
        if piece is None:
            return b""
        if token in self.special_ids:
            return piece.encode()
        if self.byte_level:  # GPT-2's printable stand-ins for bytes
            return bytes(self.byte_decoder[c] for c in piece)
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):  # sentencepiece's byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()


class GGUFTokenizer(HFTokenizer):
    """A GGUF file's tokenizer (gguf_vocab.py), served as HFTokenizer serves tokenizer.json.
    The file holds what a folder's tokenizer_config.json would, so nothing beside it is read:
    its add_bos_token (add_eos_token) decides whether a text gets BOS (EOS), as in transformers
    and llama.cpp."""

    def __init__(self, model_path: str):  # not Tokenizer's: it reads tokenizer_config.json
        import gguf_vocab

        self.path = tokenizer_file(model_path)
        vocab = gguf_vocab.read(self.path)
        self.use_backend(vocab.backend)
        self.bos_id, self.eos_id, self.pad_id = vocab.bos_id, vocab.eos_id, vocab.pad_id
        self.stop_ids = vocab.stop_ids
        self.add_bos, self.add_eos = vocab.add_bos, vocab.add_eos
        self.config, self.chat_template = vocab.config, vocab.chat_template


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters, which byte-level BPE vocabularies use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


# --- exact text, a piece at a time -----------------------------------------------------------

class TextStream:
    """The text that generated tokens add to a prompt, a piece at a time, such that the
    pieces add up to decode(prompt + tokens) minus decode(prompt). Each new token is decoded
    together with the few tokens before it (so that, e.g., sentencepiece keeps its leading
    space), and a piece that ends in the middle of a character (U+FFFD) is held back until
    the character is whole or flush() is called."""

    CONTEXT = 6  # prompt tokens decoded with the first new tokens

    def __init__(self, tokenizer: Tokenizer, prompt_tokens: list[int]):
        self.tokenizer = tokenizer
        self.tokens = list(prompt_tokens[-self.CONTEXT:])
        self.start = 0  # tokens[start:read] decode to the text just before what is held back
        self.read = len(self.tokens)

    def add(self, token: int) -> str:
        self.tokens.append(token)
        return self.take(final=False)

    def flush(self) -> str:
        """What is held back, at the end of the generation."""
        return self.take(final=True)

    def take(self, final: bool) -> str:
        decode = self.tokenizer.decode
        before = decode(self.tokens[self.start:self.read])
        text = decode(self.tokens[self.start:])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.tokens = self.tokens[self.read:]
        self.start, self.read = 0, len(self.tokens)
        return text[len(before):]
