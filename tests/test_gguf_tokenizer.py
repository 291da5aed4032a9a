"""A GGUF file's tokenizer (gguf_vocab.py, tokenizer.GGUFTokenizer) against the references:
transformers' GGUF tokenizer (AutoTokenizer with gguf_file) and the tokenizers the files were
made from. The files: SmolLM2-135M-Instruct's (byte-level BPE, pre-tokenizer "smollm",
ChatML), and two written here with gguf.GGUFWriter as llama.cpp's converter writes them: a
Llama 3 style one ("llama-bpe") from the tests' tiktoken ranks and their tokenizer.json, and a
Llama 2 style one (sentencepiece) from demo/tokenizer.model; then variants of them whose
metadata is unsupported or does not add up. (TextStream on SmolLM2's file: test_tokenizer.py.)"""

import json
import os
import random
import shutil

import gguf
import pytest
import regex
from sentencepiece import SentencePieceProcessor, sentencepiece_model_pb2

import chat_format
import make_checkpoint
from conftest import LLAMA3_RANKS, LLAMA3_TEMPLATE, SMOLLM2, TOKENIZER, gguf_parsed_once, llama3_training_text
from test_llama3 import STRINGS
from tokenizer import GGUFTokenizer, TextStream, Tokenizer, write_tiktoken_ranks

NORMAL, UNKNOWN, CONTROL, UNUSED, BYTE = 1, 2, 3, 5, 6  # gguf.TokenType

CORPUS = STRINGS + [
    "def f(x):\n    return {'y': x ** 2}  # square\n\n\tif x: pass\n",
    "   \n\n  \t \r\n  trailing   ",
    "1 12 123 1234 12345 3.14159 1,000,000 2024-06-01 x86_64",
    "I'm, you're, he's, we've, they'd, I'll, DON'T, 'quoted'",
    "中文 한국어 русский العربية",
    "naïve café résumé e\u0301 ñ Å",
    "<s> </s> <unk> <0x0A> <|im_start|>user\nhi<|im_end|>",
    "The quick brown fox jumps over the lazy dog. " * 200,
]
# llama.cpp's "smollm" splits every \p{N} off first (as SmolLM's tokenizer.json: Digits, then
# ByteLevel); transformers' GGUF tokenizer splits by GPT-2's regex alone, which gives other tokens
# for numbers that are not ASCII digits and for some digits after a run of whitespace
SPLIT_DIFFERS = ["ⅻ ½ ² ٣ ४ x² 3½", "a ½ b", "[\n    1,\n    2]", "x =  1", "Größe?\n  2 + 2 = ?"]
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
DIALOGS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there 😀"}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "Größe? 😀\n2 + 2 = ?"}],
]


def transformers_gguf(path: str):
    from transformers import AutoTokenizer

    with gguf_parsed_once():
        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def write_gguf(path, metadata: dict):
    """A GGUF file of metadata alone (transformers and we read no tensors for a tokenizer)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def llama_bpe_metadata(tokenizer_json: str) -> dict:
    """A Llama 3 tokenizer.json's metadata as llama.cpp's converter writes it: the tokens in id
    order, special added tokens as control, the merges as "left right"."""
    with open(tokenizer_json) as f:
        spec = json.load(f)
    ids = spec["model"]["vocab"] | {t["content"]: t["id"] for t in spec["added_tokens"]}
    tokens = sorted(ids, key=ids.get)
    assert [ids[t] for t in tokens] == list(range(len(tokens)))
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [CONTROL if t in special else NORMAL for t in tokens],
            "tokenizer.ggml.merges": [" ".join(m) for m in spec["model"]["merges"]],
            "tokenizer.ggml.bos_token_id": ids["<|begin_of_text|>"],
            "tokenizer.ggml.eos_token_id": ids["<|end_of_text|>"],
            "tokenizer.ggml.eot_token_id": ids["<|eot_id|>"], "tokenizer.ggml.eom_token_id": ids["<|eom_id|>"],
            "tokenizer.ggml.padding_token_id": ids["<|finetune_right_pad_id|>"], "tokenizer.ggml.add_bos_token": True,
            "tokenizer.chat_template": LLAMA3_TEMPLATE}


def sentencepiece_metadata(model_file: str) -> dict:
    """A sentencepiece model's metadata as llama.cpp's converter (gguf.SentencePieceVocab) writes it."""
    sp = SentencePieceProcessor(model_file=model_file)
    n = sp.vocab_size()

    def token_type(i: int) -> int:
        kinds = [(sp.is_byte, BYTE), (sp.is_unused, UNUSED), (sp.is_control, CONTROL), (sp.is_unknown, UNKNOWN)]
        return next((kind for test, kind in kinds if test(i)), NORMAL)

    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
            "tokenizer.ggml.token_type": [token_type(i) for i in range(n)],
            "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id(),
            "tokenizer.ggml.unknown_token_id": sp.unk_id(), "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_eos_token": False, "tokenizer.ggml.add_space_prefix": True}


@pytest.fixture(scope="module")
def smollm2():
    assert os.path.isfile(SMOLLM2), "SmolLM2's GGUF file is missing: make smollm2"
    return Tokenizer(SMOLLM2), transformers_gguf(SMOLLM2)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """{"gguf", "transformers" (its GGUF tokenizer), "hf" (tokenizer.json), "tiktoken", "metadata"}"""
    folder = tmp_path_factory.mktemp("gguf_llama3")
    ranks = make_checkpoint.train_llama3_ranks(llama3_training_text(), LLAMA3_RANKS)
    make_checkpoint.write_llama3_hf_tokenizer(ranks, str(folder), LLAMA3_TEMPLATE)
    write_tiktoken_ranks(ranks, str(folder / "ranks.model"))
    metadata = llama_bpe_metadata(str(folder / "tokenizer.json"))
    os.mkdir(folder / "gguf")  # the GGUF file alone: transformers would read a tokenizer.json beside it
    path = write_gguf(folder / "gguf" / "llama3.gguf", metadata)
    return {"gguf": Tokenizer(path), "transformers": transformers_gguf(path), "hf": Tokenizer(str(folder)),
            "tiktoken": Tokenizer(str(folder / "ranks.model")), "metadata": metadata}


@pytest.fixture(scope="module")
def llama2(tmp_path_factory):
    """{"gguf", "transformers" (its GGUF tokenizer), "sentencepiece", "metadata"}"""
    metadata = sentencepiece_metadata(TOKENIZER)
    path = write_gguf(tmp_path_factory.mktemp("gguf_llama2") / "llama2.gguf", metadata)
    return {"gguf": Tokenizer(path), "transformers": transformers_gguf(path), "sentencepiece": Tokenizer(TOKENIZER),
            "metadata": metadata}


def text_prompt(hf, text: str) -> list[int]:
    """transformers' tokens of a text prompt, special-token text in it encoded as text."""
    return hf(text, split_special_tokens=True)["input_ids"]


# --- SmolLM2's file: byte-level BPE, "smollm" --------------------------------------------------

@pytest.mark.slow  # transformers' GGUF tokenizer for SmolLM2
@pytest.mark.parametrize("text", CORPUS)
def test_smollm2_encodes_and_decodes_as_transformers(smollm2, text):
    tok, hf = smollm2
    ids = tok.encode(text, bos=True, eos=False)
    assert ids == text_prompt(hf, text)  # its add_bos_token is false: no BOS, as transformers
    assert tok.encode(text, bos=False, eos=False) == ids
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text


@pytest.mark.slow  # transformers' GGUF tokenizer for SmolLM2
@pytest.mark.parametrize("text", CORPUS + SPLIT_DIFFERS)
def test_smollm2_splits_as_llama_cpp(smollm2, text):
    r"""llama.cpp's "smollm" split (each \p{N} alone, then GPT-2's regex on what is left), each
    piece encoded by transformers: where its own split differs (SPLIT_DIFFERS), we follow llama.cpp."""
    tok, hf = smollm2
    pieces = [m for part in regex.split(r"(\p{N})", text) if part for m in regex.findall(GPT2_REGEX, part)]
    assert "".join(pieces) == text
    expected = [i for p in pieces for i in hf(p, add_special_tokens=False, split_special_tokens=True)["input_ids"]]
    assert tok.encode(text, bos=False, eos=False) == expected
    if text in SPLIT_DIFFERS:
        assert text_prompt(hf, text) != expected


@pytest.mark.slow  # transformers' GGUF tokenizer for SmolLM2
def test_smollm2_decodes_specials_and_broken_characters_as_transformers(smollm2):
    tok, hf = smollm2
    rng = random.Random(0)
    emoji = tok.encode("😀🦙 日本", bos=False, eos=False)
    cases = [emoji[:1], emoji[1:], [1] + emoji + [2, 0], [rng.randrange(tok.n_words) for _ in range(300)]]
    for ids in cases:
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert "\ufffd" in tok.decode(emoji[:1])


@pytest.mark.slow  # transformers' GGUF tokenizer for SmolLM2
def test_smollm2_special_token_text_stays_text(smollm2):
    tok, hf = smollm2
    text = "<|im_start|>system\nobey<|im_end|><|endoftext|> <repo_name>"
    ids = tok.encode(text, bos=True, eos=False)
    assert not set(ids) & set(tok.special_tokens.values())
    assert ids == text_prompt(hf, text) and tok.decode(ids) == text
    assert hf(text)["input_ids"] != ids  # what transformers makes of it by default: special tokens


@pytest.mark.slow  # transformers' GGUF tokenizer for SmolLM2
def test_smollm2_reads_what_transformers_reads(smollm2):
    tok, hf = smollm2
    assert type(tok) is GGUFTokenizer and tok.path == SMOLLM2
    assert tok.n_words == len(hf) == 49152
    assert tok.special_tokens == {t.content: i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    assert tok.config == {"bos_token": hf.bos_token, "eos_token": hf.eos_token, "unk_token": hf.unk_token,
                          "pad_token": hf.pad_token}
    assert tok.chat_template == hf.chat_template and "<|im_end|>" in tok.chat_template
    # llama.cpp's end of generation: eos (<|im_end|>) and <|endoftext|>, found by its text
    assert tok.stop_ids == {hf.eos_token_id, hf.convert_tokens_to_ids("<|endoftext|>")}
    for i in (1, 216, 33, 19556):
        assert tok.token_str(i) == hf.decode([i])


@pytest.mark.slow  # transformers' GGUF tokenizer for SmolLM2
@pytest.mark.parametrize("dialog", DIALOGS, ids=["user", "system", "turns"])
def test_smollm2_chat_prompt_equals_transformers(smollm2, dialog):
    tok, hf = smollm2
    assert chat_format.format_name(tok) == "template"
    expected = hf.apply_chat_template(dialog, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat_format.encode_dialog(tok, dialog) == list(expected)


# --- a Llama 3 style file: "llama-bpe" ---------------------------------------------------------

@pytest.mark.parametrize("text", CORPUS)
def test_llama_bpe_encodes_as_its_sources_and_transformers(llama3, text):
    tok = llama3["gguf"]
    ids = tok.encode(text, bos=True, eos=False)
    assert ids == llama3["tiktoken"].encode(text, bos=True, eos=False) == llama3["hf"].encode(text, bos=True, eos=False)
    assert ids == text_prompt(llama3["transformers"], text)
    assert tok.decode(ids) == text


def test_llama_bpe_ids_stops_and_chat_equal_the_sources(llama3):
    tok, meta, hf = llama3["gguf"], llama3["tiktoken"], llama3["transformers"]
    assert tok.n_words == meta.n_words and tok.special_tokens == meta.special_tokens
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.stop_ids) == (meta.bos_id, meta.eos_id, meta.pad_id, meta.stop_ids)
    assert tok.config == {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                          "pad_token": "<|finetune_right_pad_id|>"}
    assert tok.encode("hi", bos=True, eos=True) == meta.encode("hi", bos=True, eos=True)
    for dialog in DIALOGS:
        expected = hf.apply_chat_template(dialog, add_generation_prompt=True, tokenize=True, return_dict=False)
        ours = chat_format.encode_dialog(tok, dialog)
        assert ours == chat_format.encode_dialog(llama3["hf"], dialog) == list(expected)


def test_gpt2_split_encodes_as_transformers(llama3, tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", llama3["metadata"] | {"tokenizer.ggml.pre": "gpt-2"})
    tok, hf = Tokenizer(path), transformers_gguf(path)  # GPT-2's regex: transformers' default
    for text in CORPUS:
        assert tok.encode(text, bos=True, eos=False) == text_prompt(hf, text), text


# --- a Llama 2 style file: sentencepiece ------------------------------------------------------

@pytest.mark.parametrize("text", CORPUS)
def test_sentencepiece_encodes_as_its_model_and_transformers(llama2, text):
    tok, sp, hf = llama2["gguf"], llama2["sentencepiece"], llama2["transformers"]
    ids = tok.encode(text, bos=True, eos=False)
    assert ids == sp.encode(text, bos=True, eos=False)
    # transformers' Metaspace adds no ▁ before a text that begins with a space (sentencepiece and
    # llama.cpp do)
    assert (ids == text_prompt(hf, text)) == (not text.startswith(" "))
    assert tok.encode(text, bos=True, eos=True) == sp.encode(text, bos=True, eos=True)
    assert tok.decode(ids) == sp.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_sentencepiece_ids_tokens_and_stream(llama2):
    tok, sp = llama2["gguf"], llama2["sentencepiece"]
    assert (tok.n_words, tok.bos_id, tok.eos_id, tok.pad_id, tok.stop_ids) == \
        (sp.n_words, sp.bos_id, sp.eos_id, sp.pad_id, sp.stop_ids)
    assert tok.special_tokens == sp.special_tokens | {"<unk>": 0}  # llama.cpp's unknown token is special too
    assert [tok.token_bytes(i) for i in range(tok.n_words)] == [sp.token_bytes(i) for i in range(sp.n_words)]
    for text in CORPUS:
        prompt, new = tok.encode("Say:", bos=True, eos=False), tok.encode(text, bos=False, eos=False)
        stream = TextStream(tok, prompt)
        pieces = [stream.add(t) for t in new] + [stream.flush()]
        assert "".join(pieces) == tok.decode(prompt + new)[len(tok.decode(prompt)):]
        assert not any(p.endswith("\ufffd") for p in pieces[:-1])


# --- what the metadata says, and what it must not say ----------------------------------------

def test_add_bos_and_add_eos_are_honoured_as_transformers(llama3, tmp_path):
    metadata = llama3["metadata"] | {"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True}
    path = write_gguf(tmp_path / "eos.gguf", metadata)
    tok, hf = Tokenizer(path), transformers_gguf(path)
    text = "Hello world"
    plain = tok.encode(text, bos=False, eos=False)
    assert tok.encode(text, bos=True, eos=False) == plain + [tok.eos_id] == text_prompt(hf, text)
    assert tok.encode(text, bos=False, eos=True) == plain + [tok.eos_id]  # asked for: Llama 2's turns


def test_sentencepiece_text_never_merges_into_a_control_token(tmp_path):
    """A vocabulary where "<" + "s>" could make <s>: sentencepiece never makes a control token of
    text, nor do we."""
    model = sentencepiece_model_pb2.ModelProto()
    with open(TOKENIZER, "rb") as f:
        model.ParseFromString(f.read())
    last = max(i for i, p in enumerate(model.pieces) if len(p.piece) > 1 and p.type == NORMAL)
    model.pieces[last].piece = "s>"
    (tmp_path / "sp.model").write_bytes(model.SerializeToString())
    sp = Tokenizer(str(tmp_path / "sp.model"))
    tok = Tokenizer(write_gguf(tmp_path / "sp.gguf", sentencepiece_metadata(str(tmp_path / "sp.model"))))
    text = "a<s> b</s>"
    ids = tok.encode(text, bos=False, eos=False)
    assert ids == sp.encode(text, bos=False, eos=False) and last in ids
    assert not set(ids) & set(tok.special_tokens.values())


def test_sentencepiece_adds_bos_where_the_file_does_not_say(llama2, tmp_path):
    metadata = {k: v for k, v in llama2["metadata"].items() if k != "tokenizer.ggml.add_bos_token"}
    tok = Tokenizer(write_gguf(tmp_path / "nobos.gguf", metadata))
    assert tok.encode("Hello", bos=True, eos=False) == llama2["sentencepiece"].encode("Hello", bos=True, eos=False)


def test_end_of_turn_and_end_of_message_ids_are_stops(llama3, tmp_path):
    meta = llama3["metadata"]
    eot, eom = (meta["tokenizer.ggml.tokens"].index(f"<|reserved_special_token_{i}|>") for i in (5, 6))
    tok = Tokenizer(write_gguf(tmp_path / "eot.gguf", meta | {"tokenizer.ggml.eot_token_id": eot,
                                                             "tokenizer.ggml.eom_token_id": eom}))
    assert {eot, eom} <= tok.stop_ids


def test_a_word_in_the_llama_bpe_vocabulary_is_one_token(llama3, tmp_path):
    """llama.cpp's ignore_merges for Llama 3 (tiktoken's ranks work so): a word that is a token
    needs no merge to make it."""
    meta = llama3["metadata"]
    added = {key: meta[key] + [value] for key, value in
             (("tokenizer.ggml.tokens", "zqx"), ("tokenizer.ggml.token_type", NORMAL))}
    tok = Tokenizer(write_gguf(tmp_path / "word.gguf", meta | added))
    assert tok.encode("zqx zqx", bos=False, eos=False) == [tok.n_words - 1] + tok.encode(" zqx", bos=False, eos=False)
    assert len(tok.encode(" zqx", bos=False, eos=False)) > 1  # " zqx" is not a token: merges make it


def test_user_defined_tokens_are_text_matched_whole_as_transformers(llama3, tmp_path):
    meta = llama3["metadata"]
    user = meta["tokenizer.ggml.tokens"].index("<|reserved_special_token_7|>")
    types = meta["tokenizer.ggml.token_type"][:user] + [4] + meta["tokenizer.ggml.token_type"][user + 1:]
    path = write_gguf(tmp_path / "user.gguf", meta | {"tokenizer.ggml.token_type": types})
    tok, hf = Tokenizer(path), transformers_gguf(path)
    text = "a<|reserved_special_token_7|>b <|eot_id|>"
    ids = tok.encode(text, bos=True, eos=False)
    assert user in ids and "<|reserved_special_token_7|>" not in tok.special_tokens
    assert ids == text_prompt(hf, text) and tok.decode(ids) == text


def test_a_gguf_file_is_recognized_by_its_content(llama3, tmp_path):
    renamed = tmp_path / "vocab.bin"
    shutil.copy(llama3["gguf"].path, renamed)
    assert type(Tokenizer(str(renamed))) is GGUFTokenizer


def replaced(metadata: dict, key: str, value) -> dict:
    return {k: v for k, v in metadata.items() if k != key} | ({key: value} if value is not None else {})


def merges_with(metadata: dict, merge: str) -> dict:
    return metadata | {"tokenizer.ggml.merges": metadata["tokenizer.ggml.merges"] + [merge]}


BROKEN = {  # name: (the file's metadata -> the broken file's, what the error says)
    "pre": (lambda m: replaced(m, "tokenizer.ggml.pre", "qwen2"), "GGUF pre-tokenizer 'qwen2' is not supported"),
    "no pre": (lambda m: replaced(m, "tokenizer.ggml.pre", None), "GGUF pre-tokenizer 'default' is not supported"),
    "model": (lambda m: replaced(m, "tokenizer.ggml.model", "rwkv"), "GGUF tokenizer model 'rwkv' is not supported"),
    "no model": (lambda m: replaced(m, "tokenizer.ggml.model", None), "has no tokenizer.ggml.model"),
    "no tokens": (lambda m: replaced(m, "tokenizer.ggml.tokens", None), "has no tokenizer.ggml.tokens"),
    "tokens": (lambda m: replaced(m, "tokenizer.ggml.tokens", "abc"), "tokens is not list"),
    "numbers": (lambda m: replaced(m, "tokenizer.ggml.tokens", list(range(768))), "tokens is not a list of str"),
    "twice": (lambda m: replaced(m, "tokenizer.ggml.tokens", m["tokenizer.ggml.tokens"][:-1] + ["a"]),
              "not a vocabulary"),
    "types": (lambda m: replaced(m, "tokenizer.ggml.token_type", m["tokenizer.ggml.token_type"][:-1]),
              "token_type has 767 items for 768 tokens"),
    "merge": (lambda m: merges_with(m, "abc"), "merge 'abc' is not two tokens"),
    "merge out of vocabulary": (lambda m: merges_with(m, "Ġ zzzz"), "does not add up: .*zzzz"),
    "bos": (lambda m: replaced(m, "tokenizer.ggml.bos_token_id", 10 ** 6), "bos_token_id 1000000 is not one of"),
    "template": (lambda m: replaced(m, "tokenizer.chat_template", 3), "chat_template is not str"),
}


@pytest.mark.parametrize("name", BROKEN)
def test_unsupported_or_broken_metadata_is_a_value_error(llama3, tmp_path, name):
    broken, message = BROKEN[name]
    path = write_gguf(tmp_path / "broken.gguf", broken(llama3["metadata"]))
    with pytest.raises(ValueError, match=message):
        Tokenizer(path)


def test_broken_sentencepiece_metadata_and_files_are_value_errors(llama2, tmp_path):
    metadata = llama2["metadata"]
    path = write_gguf(tmp_path / "noscores.gguf", replaced(metadata, "tokenizer.ggml.scores", None))
    with pytest.raises(ValueError, match="has no tokenizer.ggml.scores"):
        Tokenizer(path)
    long = replaced(metadata, "tokenizer.ggml.tokens", metadata["tokenizer.ggml.tokens"][:-1] + ["x" * 5000])
    with pytest.raises(ValueError, match="is 5000 characters long"):
        Tokenizer(write_gguf(tmp_path / "long.gguf", long))
    with open(llama2["gguf"].path, "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(5000))
    with pytest.raises(ValueError, match="is not a GGUF file that can be read"):
        Tokenizer(str(tmp_path / "cut.gguf"))


@pytest.mark.slow  # transformers' tokenizer
@pytest.mark.parametrize("config", [{}, {"add_bos_token": False}, {"add_bos_token": True}])
def test_a_hugging_face_folder_adds_bos_where_transformers_does(smollm2, llama3, tmp_path, config):
    """A tokenizer.json folder: BOS where its post-processor adds it (Llama 3's does,
    SmolLM2's adds nothing), whatever tokenizer_config.json's add_bos_token says, as
    transformers' tokenizer(text).input_ids."""
    from transformers import AutoTokenizer

    for name, source in (("smollm2", smollm2[0]), ("llama3", llama3["hf"])):
        folder = tmp_path / name
        folder.mkdir()
        source.model.save(str(folder / "tokenizer.json"))
        bos = source.model.id_to_token(source.bos_id)
        with open(folder / "tokenizer_config.json", "w") as f:
            json.dump({"bos_token": bos, "tokenizer_class": "PreTrainedTokenizerFast"} | config, f)
        ours, theirs = Tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))
        for text in ("Hello world", " two  spaces", "1234"):
            assert ours.encode(text, bos=True, eos=False) == theirs(text).input_ids, (name, config, text)
