"""The seed documents' examples as written (tests/seed_examples.py), at TP=1 in-process and
at TP=2 on torchrun's ranks: the seed's Transformer called as model(tokens, start_pos) with
Meta's KV-cache semantics, tp_llama from a .pth file, and generate / text_completion /
chat_completion given what tp_llama(...).model returns, as TorchServe's tp_llama example
passes it."""

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import generate as G
import make_checkpoint
import seed_examples as ex
import torchrun
from conftest import DEMO, TOKENIZER
from llama2 import tp_llama
from tokenizer import Tokenizer

VOCAB = Tokenizer(TOKENIZER).n_words
TOL = 1e-4


@pytest.fixture(scope="module")
def seed_checkpoint(tmp_path_factory):
    """A checkpoint of the shapes example 2 gives (Meta's FFN rule with multiple_of 256), in
    Meta's layout (one consolidated.00.pth), and the transformers model it was made from."""
    model = make_checkpoint.random_hf_model(64, 2, 8, 2, VOCAB, multiple_of=256, seed=3)
    folders = make_checkpoint.write_layouts(model, str(tmp_path_factory.mktemp("seed")), TOKENIZER, ["meta:1"])
    return model, os.path.join(folders["meta:1"], "consolidated.00.pth")


@pytest.fixture(scope="module")
def demo():
    """The demo checkpoint as TorchServe's tp_llama example keeps it: the model and the tokenizer."""
    llama = tp_llama(None, DEMO, os.path.join(DEMO, "tokenizer.model"), 1, max_batch_size=2, max_seq_len=512)
    return llama


def tokens(n: int = 10) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(7))


def test_example1_counts_the_parameters_transformers_counts():
    config = LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=VOCAB, tie_word_embeddings=False)
    assert ex.seed000_example1(VOCAB) == sum(p.numel() for p in LlamaForCausalLM(config).parameters())


def test_example2_loads_a_pth_file_whose_model_gives_transformers_logits(seed_checkpoint):
    reference, path = seed_checkpoint
    llama = ex.seed000_example2(path, TOKENIZER, VOCAB, 1)
    with torch.no_grad():
        want = reference(tokens()).logits
    assert (llama.model(tokens(), 0) - want).abs().max() <= TOL


def test_example3_keeps_a_kv_cache_with_meta_semantics():
    """Logits (2, 10, vocab) whose argmax is next_tokens; then, as Meta's reference decodes,
    the next tokens at start_pos 10 (row i in cache row i) give the logits of one pass over
    all 11, and a prompt fed in two parts the logits of one pass."""
    model, logits, next_tokens = ex.seed000_example3(VOCAB, tokens())
    assert logits.shape == (2, 10, VOCAB)
    assert torch.equal(next_tokens, logits[:, -1].argmax(-1))
    step = model(next_tokens[:, None], 10)
    whole = model(torch.cat([tokens(), next_tokens[:, None]], 1), 0)
    assert (step[:, 0] - whole[:, -1]).abs().max() <= TOL
    assert (torch.cat([model(tokens()[:, :4], 0), model(tokens()[:, 4:], 4)], 1) - logits).abs().max() <= TOL


def test_example3_rows_are_cache_rows():
    """Row i of a batch reads and writes cache row i: a one-row call at start_pos 10 continues
    row 0's sequence, whatever row 1 holds."""
    model, logits, next_tokens = ex.seed000_example3(VOCAB, tokens())
    alone = model(next_tokens[:1, None], 10)
    whole = model(torch.cat([tokens(), next_tokens[:, None]], 1), 0)
    assert (alone[0, 0] - whole[0, -1]).abs().max() <= TOL


def test_generate_and_completions_take_tp_llamas_model(demo):
    """The TorchServe example's calls (llama.model, llama.tokenizer) answer as the Llama does."""
    prompt_tokens = [demo.tokenizer.encode("The secret of life is", bos=True, eos=False)]
    assert G.generate(demo.model, prompt_tokens, 16, temperature=0) == G.generate(demo, prompt_tokens, 16,
                                                                                   temperature=0)
    torch.manual_seed(5)
    texts = ex.seed002_example1(demo.model, demo.tokenizer)
    torch.manual_seed(5)
    assert texts == demo.text_completion(["The theory of relativity states that",
                                          "In machine learning, a transformer is"], 128, temperature=0.6, top_p=0.9)
    assert all(t["generation"] for t in texts)
    chats = ex.seed002_example2(demo.model, demo.tokenizer)
    assert [c["generation"]["role"] for c in chats] == ["assistant", "assistant"]
    assert all(c["generation"]["content"] for c in chats)


def test_a_bare_transformer_needs_a_tokenizer_to_generate():
    model, _, _ = ex.seed000_example3(VOCAB, tokens())
    with pytest.raises(TypeError, match="tokenizer="):
        G.generate(model, [[1, 2, 3]], 4)
    out, _ = G.generate(model, [[1, 2, 3]], 4, temperature=0, tokenizer=Tokenizer(TOKENIZER))
    assert len(out[0]) <= 4


def test_example3_samples_within_the_nucleus():
    assert ex.seed002_example3() in (0, 1, 2, 3)


@pytest.mark.slow
def test_examples_at_tp2(seed_checkpoint, demo, tmp_path):
    """Every example on two ranks: both ranks get the same answers, example 2's model the
    logits of transformers, and greedy generation the tokens of TP=1."""
    reference, path = seed_checkpoint
    ranks = torchrun.run("seeds_worker.py", 2, tmp_path, path, DEMO, timeout=300)
    with torch.no_grad():
        want = reference(tokens()).logits
    prompt_tokens = [demo.tokenizer.encode("The secret of life is", bos=True, eos=False)]
    greedy, _ = G.generate(demo.model, prompt_tokens, 16, temperature=0)
    for r in ranks:
        assert r["parameters"] == ranks[0]["parameters"]
        assert (r["logits"] - want).abs().max() <= TOL
        assert r["greedy"] == greedy
        assert r["texts"] == ranks[0]["texts"] and r["chats"] == ranks[0]["chats"]
        assert r["forward_shape"] == (2, 10, VOCAB) and r["sampled"] in (0, 1, 2, 3)
    assert all(ranks[0]["texts"]) and all(ranks[0]["chats"])
