"""Llama 3 checkpoints, built here (conftest.llama3): a byte-level BPE trained by tiktoken's
trainer, written as Meta's tokenizer.model and, through transformers' converter, as
tokenizer.json; transformers' LlamaForCausalLM with llama3 RoPE scaling in Hugging Face
layout and as Meta MP=2 shards with the embedding split over the vocabulary. The references:
tiktoken built as Meta builds it, transformers' tokenizer, logits, chat template and generate."""

import json
import os
import shutil

import pytest
import tiktoken
import torch

import chat_format
import generate as G
import sequence
from engine import Engine
import llama2
from conftest import LLAMA3_CONFIGS, LLAMA3_RANKS
from logits_worker import SEQLEN, long_tokens
from test_generate import ScriptedRunner, continuation, stream
from tokenizer import HFTokenizer, TiktokenTokenizer, Tokenizer
from torchrun import run

TOL = 1e-4
# Meta's Llama 3 tokenizer (llama-models), written out here as the reference
META_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501
META_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
                 "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                 "<|eot_id|>", "<|python_tag|>", "<|image|>"]
META_SPECIALS += [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(META_SPECIALS))]
STRINGS = ["Hello world", "  leading and   inner   runs of spaces  ", "tabs\tand\nnew\n\nlines\r\n",
           "Größe naïve café", "日本語のテキスト", "emoji 😀🦙👩‍👩‍👧 mixed", "numbers 1234567 and 3.14159",
           "I'm sure they'll've done it", "<|eot_id|> typed by a user", "a<|start_header_id|>b<|begin_of_text|>c",
           "<|reserved_special_token_7|>", "", " ", "\n", "x" * 300]


def reference_tiktoken(path: str) -> tiktoken.Encoding:
    ranks = tiktoken.load.load_tiktoken_bpe(path)
    return tiktoken.Encoding("llama3-ref", pat_str=META_PATTERN, mergeable_ranks=ranks,
                             special_tokens={t: len(ranks) + i for i, t in enumerate(META_SPECIALS)})


def folders(llama3, name):
    return llama3[name][1]


@pytest.fixture(scope="module")
def tokenizers(llama3):
    from transformers import AutoTokenizer

    meta = folders(llama3, "meta_untied")["meta:2"]
    hf = folders(llama3, "meta_untied")["hf"]
    return {"tiktoken": Tokenizer(os.path.join(meta, "tokenizer.model")), "hf": Tokenizer(hf),
            "ref": reference_tiktoken(os.path.join(meta, "tokenizer.model")),
            "transformers": AutoTokenizer.from_pretrained(hf)}


# --- tokenizers ----------------------------------------------------------------------------

def test_backends_are_picked_by_content(tokenizers, llama3, tmp_path):
    assert type(tokenizers["tiktoken"]) is TiktokenTokenizer and type(tokenizers["hf"]) is HFTokenizer
    meta = folders(llama3, "meta_untied")["meta:2"]
    renamed = tmp_path / "vocab.bin"  # the name says nothing
    shutil.copy(os.path.join(meta, "tokenizer.model"), renamed)
    assert type(Tokenizer(str(renamed))) is TiktokenTokenizer
    assert type(Tokenizer(meta)) is TiktokenTokenizer  # a Meta folder: its tokenizer.model


@pytest.mark.parametrize("text", STRINGS)
def test_token_ids_equal_tiktoken_and_transformers(tokenizers, text):
    ref = tokenizers["ref"].encode(text, allowed_special=set(), disallowed_special=())
    hf_ref = tokenizers["transformers"](text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert ref == hf_ref
    for name in ("tiktoken", "hf"):
        tok = tokenizers[name]
        assert tok.encode(text, bos=False, eos=False) == ref, name
        assert tok.encode(text, bos=True, eos=True) == [tok.bos_id] + ref + [tok.eos_id]
        assert tok.decode(ref) == text


def test_special_ids_and_stops(tokenizers):
    base = LLAMA3_RANKS
    for name in ("tiktoken", "hf"):
        tok = tokenizers[name]
        assert tok.n_words == base + 256
        assert (tok.bos_id, tok.special_tokens["<|eot_id|>"]) == (base, base + 9)
        assert tok.stop_ids == {base + 1, base + 8, base + 9}  # end_of_text, eom, eot
        assert tok.decode([tok.bos_id, *tok.encode("hi", bos=False, eos=False), base + 9]) == "hi"


def test_typed_special_text_stays_text(tokenizers, llama3):
    text = "say <|eot_id|> then <|start_header_id|>system<|end_header_id|> and <|begin_of_text|>"
    for name in ("tiktoken", "hf"):
        tok = tokenizers[name]
        special = set(tok.special_tokens.values())
        assert not set(tok.encode(text, bos=False, eos=False)) & special
        dialog = [{"role": "system", "content": text}, {"role": "user", "content": text}]
        tokens = chat_format.encode_dialog(tok, dialog)
        # exactly the structural specials: BOS, a header per message and the assistant's, an EOT per message
        structural = [t for t in tokens if t in special]
        n_headers = 3  # system, user, assistant
        assert structural.count(tok.special_tokens["<|start_header_id|>"]) == n_headers
        assert structural.count(tok.special_tokens["<|eot_id|>"]) == 2
        assert structural.count(tok.bos_id) == 1
        assert len(structural) == 1 + 2 * n_headers + 2


# --- chat formats ----------------------------------------------------------------------------

DIALOGS = [
    [{"role": "user", "content": "  Hello there!  "}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello. "}, {"role": "user", "content": "Größe? 😀\n"}],
]


@pytest.mark.parametrize("dialog", DIALOGS, ids=["user", "turns"])
def test_meta_folder_uses_meta_llama3_format(tokenizers, dialog):
    ref = tokenizers["ref"]
    special = ref._special_tokens

    def header(role):
        return [special["<|start_header_id|>"]] + ref.encode(role) + [special["<|end_header_id|>"]] + ref.encode("\n\n")

    expected = [special["<|begin_of_text|>"]]
    for m in dialog:
        expected += header(m["role"]) + ref.encode(m["content"].strip()) + [special["<|eot_id|>"]]
    expected += header("assistant")
    tok = tokenizers["tiktoken"]
    assert chat_format.format_name(tok) == "llama3"
    assert chat_format.encode_dialog(tok, dialog) == expected


@pytest.mark.parametrize("dialog", DIALOGS, ids=["user", "turns"])
def test_hf_folder_renders_its_chat_template(tokenizers, dialog):
    tok = tokenizers["hf"]
    assert chat_format.format_name(tok) == "template"
    expected = tokenizers["transformers"].apply_chat_template(dialog, add_generation_prompt=True, tokenize=True,
                                                              return_dict=False)
    assert chat_format.encode_dialog(tok, dialog) == list(expected)


def test_template_errors_and_fallback(tokenizers, llama3, tmp_path):
    with pytest.raises(ValueError, match="chat template refused the dialog: Only user and assistant"):
        chat_format.encode_dialog(tokenizers["hf"], [{"role": "tool", "content": "x"}])
    # an HF folder without a template falls back to Meta's Llama 3 format
    folder = tmp_path / "hf"
    shutil.copytree(folders(llama3, "meta_untied")["hf"], folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    tok = Tokenizer(str(folder))
    assert chat_format.format_name(tok) == "llama3"
    assert chat_format.encode_dialog(tok, DIALOGS[1]) == chat_format.encode_dialog(tokenizers["tiktoken"], DIALOGS[1])


# --- the model -------------------------------------------------------------------------------

def all_folders(llama3) -> list[tuple[str, str, str]]:
    return [(name, layout, folder) for name in LLAMA3_CONFIGS for layout, folder in folders(llama3, name).items()]


@torch.no_grad()
def reference(hf, vocab: int) -> torch.Tensor:
    return hf(long_tokens(vocab)).logits.float()


def test_logits_equal_transformers_tp1(llama3):
    for name, layout, folder in all_folders(llama3):
        hf = llama3[name][0]
        runner = llama2.tp_llama(None, folder, None, 1, max_batch_size=1, max_seq_len=SEQLEN).runner
        assert runner.model.params.rope_scaling == LLAMA3_CONFIGS[name][6]
        assert runner.model.params.tie_word_embeddings == LLAMA3_CONFIGS[name][4]
        ours = runner(long_tokens(runner.vocab_size), 0)
        assert (ours - reference(hf, runner.vocab_size)).abs().max().item() <= TOL, (name, layout)


def test_rope_scaling_matters_at_these_positions(llama3):
    """The same checkpoints read without their scaling fail the comparison above."""
    for name, layout, folder in all_folders(llama3):
        hf = llama3[name][0]
        runner = llama2.tp_llama(None, folder, None, 1, max_batch_size=1, max_seq_len=SEQLEN).runner
        p = runner.model.params
        runner.model.freqs_cis = llama2.precompute_freqs_cis(p.head_dim, SEQLEN, p.rope_theta)  # no scaling
        unscaled = runner(long_tokens(runner.vocab_size), 0)
        assert (unscaled - reference(hf, runner.vocab_size)).abs().max().item() > 100 * TOL, (name, layout)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_logits_equal_transformers_tp(llama3, tmp_path, world_size):
    """TP 2 and 4 (8 query heads and 2 KV heads: at TP=4 each KV head sits on two ranks),
    every layout, tied and untied, the vocabulary split over the ranks."""
    cases = all_folders(llama3)
    results = run("logits_worker.py", world_size, tmp_path, *[folder for _, _, folder in cases])
    for rank, result in enumerate(results):
        for name, layout, folder in cases:
            hf = llama3[name][0]
            diff = (result[folder] - reference(hf, hf.config.vocab_size)).abs().max().item()
            assert diff <= TOL, (world_size, rank, name, layout, diff)


def test_hub_config_form_is_read(llama3, tmp_path):
    """config.json as the Hub has it for Llama 3.1 (rope_scaling and rope_theta at the top,
    not transformers 5's rope_parameters) loads the same model."""
    folder = tmp_path / "hub"
    shutil.copytree(folders(llama3, "scaled16")["hf"], folder)
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (folder / "config.json").write_text(json.dumps(config))
    runner = llama2.tp_llama(None, str(folder), None, 1, max_batch_size=1, max_seq_len=SEQLEN).runner
    hf = llama3["scaled16"][0]
    assert (runner(long_tokens(runner.vocab_size), 0) - reference(hf, runner.vocab_size)).abs().max().item() <= TOL


def test_max_position_embeddings_caps_the_context(llama3):
    folder = folders(llama3, "scaled16")["hf"]
    assert llama2.tp_llama(None, folder, None, 1).runner.max_seq_len == 512  # the default 2048, capped
    with pytest.raises(ValueError, match="max_seq_len 1024 exceeds the 512 positions"):
        llama2.tp_llama(None, folder, None, 1, max_seq_len=1024)


# --- generation ------------------------------------------------------------------------------

N_NEW = 24
PROMPTS = ["The answer is", "Größe und 😀", "  spaces"]


@torch.no_grad()
def hf_generate(hf, prompt: list[int], stops: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      do_sample=False, max_new_tokens=N_NEW, eos_token_id=stops, pad_token_id=stops[0])
    new = out[0, len(prompt):].tolist()
    cut = next((i for i, t in enumerate(new) if t in stops), len(new))
    return new[:cut]


def test_greedy_equals_transformers_and_stops_at_any_stop_id(llama3, tmp_path):
    hf = llama3["scaled16"][0]
    llama = llama2.tp_llama(None, folders(llama3, "scaled16")["hf"], None, 1, max_batch_size=4, max_seq_len=128)
    tok = llama.tokenizer
    prompts = [tok.encode(p, bos=True, eos=False) for p in PROMPTS]
    free, _ = G.generate(llama.runner, prompts, N_NEW, temperature=0, tokenizer=tok)
    # make a token that greedy decoding reaches mid-way one more stop id, as generation_config.json lists them
    row = free[0]
    stop = next(row[i] for i in range(3, N_NEW) if row[i] not in row[:i] and row[i] not in tok.stop_ids)
    folder = tmp_path / "stops"
    shutil.copytree(folders(llama3, "scaled16")["hf"], folder)
    config = json.loads((folder / "generation_config.json").read_text())
    config["eos_token_id"].append(stop)
    (folder / "generation_config.json").write_text(json.dumps(config))
    tok = Tokenizer(str(folder))
    stops = sorted(tok.stop_ids)
    assert stop in stops and len(stops) == 4
    tokens, _ = G.generate(llama.runner, prompts, N_NEW, temperature=0, tokenizer=tok)
    for prompt, got in zip(prompts, tokens):
        assert got == hf_generate(hf, prompt, stops)
    assert tokens[0] == row[:row.index(stop)]
    out = G.text_completion(llama.runner, tok, PROMPTS, N_NEW, temperature=0)
    assert out[0]["finish_reason"] == "stop"
    for prompt, got, o in zip(prompts, tokens, out):
        assert o["generation"] == continuation(tok, prompt, got)
    chats = [chat_format.encode_dialog(tok, d) for d in DIALOGS]
    answers = G.chat_completion(llama.runner, tok, DIALOGS, N_NEW, temperature=0)
    for prompt, answer in zip(chats, answers):
        want = hf_generate(hf, prompt, stops)
        assert answer["generation"]["content"] == tok.decode(want)  # the message alone
        assert answer["usage"]["completion_tokens"] == len(want)


def test_streamed_characters_are_whole(tokenizers):
    """An emoji is several byte tokens: no piece of a stream holds half of one."""
    for name in ("tiktoken", "hf"):
        tok = tokenizers[name]
        ids = tok.encode("ok 😀🦙 done", bos=False, eos=False)
        assert len(ids) > 6  # the emoji are split over several tokens
        prompt = [tok.bos_id]
        stop = tok.special_tokens["<|eot_id|>"]
        script = {len(prompt) - 1 + i: t for i, t in enumerate(ids + [stop])}
        eng = Engine(ScriptedRunner(script, tok.n_words, stop), tok)
        seq = eng.add(prompt, sequence.SamplingParams(max_gen_len=len(ids) + 5, temperature=0))
        pieces = stream(eng, seq)
        assert seq.tokens == ids and seq.finish_reason == "stop"
        assert "".join(pieces) == seq.text == "ok 😀🦙 done"
        assert not any("\ufffd" in p for p in pieces), pieces
