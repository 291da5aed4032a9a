"""generate.py in one process: nucleus sampling, greedy and sampled generation against
transformers' LlamaForCausalLM (the `checkpoints` fixture's reference model), logprobs and
echo with Meta's semantics, seeds, top-k, stop strings, per-prompt lengths, the Llama-2
chat layout and its rules, and the continuous-batching Engine."""

import copy
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import torch.nn.functional as F

import chat_format
import generate as G
import sequence
from engine import Engine
import llama2

MAX_SEQ_LEN = 128
MAX_BATCH = 4
N_NEW = 20
PROMPTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog because", "Hi"]
ALPHA = 1e-4  # significance level of the chi-square tests (seeds are fixed: reproducible)


# --- helpers ---------------------------------------------------------------------------

def load(folder: str):
    return llama2.tp_llama(None, folder, os.path.join(folder, "tokenizer.model"), 1, max_batch_size=MAX_BATCH,
                           max_seq_len=MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def mha(checkpoints):
    hf, folders = checkpoints["mha"]
    return hf, load(folders["hf"])


def encode_all(tok, prompts=PROMPTS):
    tokens = [tok.encode(p, bos=True, eos=False) for p in prompts]
    assert len({len(t) for t in tokens}) == len(tokens), "the prompts must have different lengths"
    return tokens


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int, eos_id: int) -> list[int]:
    """transformers' greedy generation, cut before EOS as Meta's reference cuts it."""
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      do_sample=False, max_new_tokens=n, eos_token_id=eos_id, pad_token_id=eos_id)
    new = out[0, len(prompt):].tolist()
    return new[:new.index(eos_id)] if eos_id in new else new


def continuation(tok, prompt: list[int], new: list[int]) -> str:
    """The exact text new tokens add to a prompt: what prompt + new decode to, minus the prompt's text."""
    return tok.decode(prompt + new)[len(tok.decode(prompt)):]


@torch.no_grad()
def hf_log_probs(hf, ids: list[int]) -> torch.Tensor:
    """(len(ids) - 1, vocab): log_softmax of the reference logits that predict ids[1:]."""
    return F.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


def chosen(log_probs: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return log_probs.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi2_{k-1} >= statistic): the upper regularised incomplete gamma function."""
    counts, probs = counts.double(), probs.double()
    expected = probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor((len(counts) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(df, stat / 2).item()


def draw(probs: torch.Tensor, p: float, n: int, seed: int) -> torch.Tensor:
    """n draws of sample_top_p from one distribution, as one (n, vocab) batch."""
    torch.manual_seed(seed)
    out = G.sample_top_p(probs.expand(n, -1).clone(), p)
    assert out.shape == (n, 1) and out.dtype == torch.long
    return torch.bincount(out[:, 0], minlength=probs.numel())


# --- sample_top_p ------------------------------------------------------------------------

def test_sample_top_p_boundary_token_stays_in_and_frequencies_match():
    # the case, in shuffled order so that the index mapping is exercised too
    base = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    order = torch.tensor([3, 0, 4, 2, 1])
    probs = base[order]  # probs[i] = base[order[i]]
    counts = draw(probs, 0.9, 40_000, seed=0)
    outside = (order == 4).nonzero()[0, 0]  # where the 0.05 token sits
    assert counts[outside] == 0, "a token outside the nucleus was drawn"
    kept = torch.ones(5, dtype=torch.bool)
    kept[outside] = False
    assert (counts[kept] > 0).all(), "the nucleus must hold 4 tokens (the one crossing p stays in)"
    nucleus = probs[kept] / probs[kept].sum()
    assert chi_square_pvalue(counts[kept], nucleus) > ALPHA
    # the same draws are clearly not from the untruncated distribution, nor from a
    # 3-token nucleus: the test has the power to see a wrong cut
    assert chi_square_pvalue(counts, probs) < ALPHA
    top3 = probs * (probs > 0.12)
    assert chi_square_pvalue(counts[kept], (top3 / top3.sum())[kept] + 1e-12) < ALPHA


def test_sample_top_p_exactly_reaching_p_is_enough():
    # cumulative 0.5, 0.75 (== p, exact in binary floating point), 0.875, 1.0
    probs = torch.tensor([0.125, 0.5, 0.125, 0.25])
    counts = draw(probs, 0.75, 20_000, seed=1)
    assert counts[0] == 0 and counts[2] == 0, f"only the 2 tokens that reach p=0.75 may be drawn: {counts}"
    assert chi_square_pvalue(counts[[1, 3]], torch.tensor([2 / 3, 1 / 3])) > ALPHA


def test_sample_top_p_batch_rows_independent_and_extremes():
    vocab = 50
    torch.manual_seed(2)
    probs = torch.softmax(torch.randn(3, vocab) * 3, dim=-1)
    before = probs.clone()
    out = G.sample_top_p(probs, 0.0)  # p = 0: only the most probable token
    assert torch.equal(probs, before), "sample_top_p must not modify its input"
    assert out.shape == (3, 1)
    assert torch.equal(out[:, 0], probs.argmax(-1))
    # p = 1: the whole distribution, per row
    for row in range(3):
        counts = draw(probs[row], 1.0, 30_000, seed=3 + row)
        big = probs[row] * 30_000 >= 5  # chi-square needs expected counts >= 5: pool the tail
        assert 1 <= (~big).sum() < vocab - 10
        obs = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
        exp = torch.cat([probs[row][big], probs[row][~big].sum(0, keepdim=True)])
        assert chi_square_pvalue(obs, exp) > ALPHA


def test_sample_top_p_generator_reproduces():
    probs = torch.softmax(torch.randn(4, 100, generator=torch.Generator().manual_seed(0)), -1)
    a = G.sample_top_p(probs, 0.9, torch.Generator().manual_seed(7))
    b = G.sample_top_p(probs, 0.9, torch.Generator().manual_seed(7))
    draws = [G.sample_top_p(probs, 0.9, torch.Generator().manual_seed(s)) for s in range(8)]
    assert torch.equal(a, b)
    assert len({tuple(d[:, 0].tolist()) for d in draws}) > 1


# --- generate: greedy and logprobs against transformers -----------------------------------

@pytest.mark.parametrize("name, layout", [("mha", "hf"), ("gqa", "meta:1")])
def test_greedy_matches_transformers(checkpoints, name, layout):
    hf, folders = checkpoints[name]
    llama = load(folders[layout])
    tok = llama.tokenizer
    prompts = encode_all(tok)
    tokens, logprobs = G.generate(llama.runner, prompts, N_NEW, temperature=0, tokenizer=tok)
    assert logprobs is None
    for prompt, got in zip(prompts, tokens):
        want = hf_greedy(hf, prompt, N_NEW, tok.eos_id)
        assert len(want) > 0 and got == want


def test_logprobs_equal_reference(mha):
    hf, llama = mha
    tok = llama.tokenizer
    prompts = encode_all(tok)
    tokens, logprobs = G.generate(llama.runner, prompts, N_NEW, temperature=0, logprobs=True, tokenizer=tok)
    echo_tokens, echo_logprobs = G.generate(llama.runner, prompts, N_NEW, temperature=0, logprobs=True,
                                            echo=True, tokenizer=tok)
    for prompt, new, lp, e_tok, e_lp in zip(prompts, tokens, logprobs, echo_tokens, echo_logprobs):
        assert new and len(lp) == len(new)
        ref = chosen(hf_log_probs(hf, prompt + new), prompt + new)
        torch.testing.assert_close(torch.tensor(lp), ref[len(prompt) - 1:], atol=1e-4, rtol=0)
        # echo: the prompt, then the same new tokens; the first token has nothing before it
        assert e_tok == prompt + new and len(e_lp) == len(e_tok)
        assert e_lp[0] == 0.0
        torch.testing.assert_close(torch.tensor(e_lp[1:]), ref, atol=1e-4, rtol=0)


def test_sampled_logprobs_are_of_the_raw_logits(mha):
    """As in Meta's code, logprobs are of the model's distribution, not the tempered one."""
    hf, llama = mha
    tok = llama.tokenizer
    prompts = encode_all(tok)
    tokens, logprobs = G.generate(llama.runner, prompts, N_NEW, temperature=1.7, top_p=0.95, logprobs=True,
                                  tokenizer=tok, seed=5)
    greedy, _ = G.generate(llama.runner, prompts, N_NEW, temperature=0, tokenizer=tok)
    assert tokens != greedy  # really sampled
    for prompt, new, lp in zip(prompts, tokens, logprobs):
        ref = chosen(hf_log_probs(hf, prompt + new), prompt + new)[len(prompt) - 1:]
        torch.testing.assert_close(torch.tensor(lp), ref, atol=1e-4, rtol=0)


def test_row_stops_at_eos(mha):
    """Use a token that greedy decoding produces mid-way as EOS: that row stops before it
    (nothing of it in tokens or logprobs), the other rows go on exactly as transformers."""
    hf, llama = mha
    tok = llama.tokenizer
    prompts = encode_all(tok)
    greedy, _ = G.generate(llama.runner, prompts, N_NEW, temperature=0, tokenizer=tok)
    row0 = greedy[0]
    cut = next(i for i in range(3, N_NEW) if row0[i] not in row0[:i])
    eos_tok = copy.copy(tok)
    eos_tok.eos_id, eos_tok.stop_ids = row0[cut], frozenset([row0[cut]])
    tokens, logprobs = G.generate(llama.runner, prompts, N_NEW, temperature=0, logprobs=True, tokenizer=eos_tok)
    assert tokens[0] == row0[:cut]
    for prompt, got, lp in zip(prompts, tokens, logprobs):
        assert got == hf_greedy(hf, prompt, N_NEW, eos_tok.eos_id)
        assert len(lp) == len(got)
    out = G.text_completion(llama.runner, eos_tok, PROMPTS, N_NEW, temperature=0)
    assert out[0]["finish_reason"] == "stop"
    assert out[0]["usage"]["completion_tokens"] == cut
    assert out[0]["generation"] == continuation(tok, prompts[0], row0[:cut])


def test_limits_raise_value_error(mha):
    _, llama = mha
    tok = llama.tokenizer
    prompts = encode_all(tok)
    longest = max(len(p) for p in prompts)
    with pytest.raises(ValueError, match="max_seq_len"):
        G.generate(llama.runner, prompts, MAX_SEQ_LEN - longest + 1, temperature=0, tokenizer=tok)
    with pytest.raises(ValueError, match="max_batch_size"):
        G.generate(llama.runner, prompts + prompts[:2], 4, temperature=0, tokenizer=tok)
    with pytest.raises(ValueError, match="max_batch_size"):
        G.text_completion(llama.runner, tok, ["a"] * (MAX_BATCH + 1), 4)
    with pytest.raises(ValueError, match="max_seq_len"):
        G.text_completion(llama.runner, tok, PROMPTS, [4, MAX_SEQ_LEN, 4])
    with pytest.raises(ValueError, match="max_gen_len"):
        G.text_completion(llama.runner, tok, PROMPTS, [4, 4])  # one length too few
    with pytest.raises(ValueError, match="max_gen_len"):
        G.generate(llama.runner, prompts, 0, tokenizer=tok)
    with pytest.raises(ValueError, match="empty"):
        G.generate(llama.runner, [[]], 4, tokenizer=tok)
    # exactly filling the context is allowed; None means: up to the end of the context
    room = [MAX_SEQ_LEN - len(p) for p in prompts]
    tokens, _ = G.generate(llama.runner, prompts, room, temperature=0, tokenizer=tok)
    out = G.text_completion(llama.runner, tok, PROMPTS, None, temperature=0)
    for prompt, o, t, n in zip(prompts, out, tokens, room):
        assert o["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(t)}
        assert o["generation"] == continuation(tok, prompt, t)
        assert (o["finish_reason"], len(t)) == ("length", n) or o["finish_reason"] == "stop" and len(t) < n


# --- text_completion options -------------------------------------------------------------

def test_text_completion_greedy_echo_logprobs_usage(mha):
    _, llama = mha
    tok = llama.tokenizer
    prompts = encode_all(tok)
    tokens, logprobs = G.generate(llama.runner, prompts, N_NEW, temperature=0, logprobs=True, tokenizer=tok)
    plain = G.text_completion(llama.runner, tok, PROMPTS, N_NEW, temperature=0)
    full = G.text_completion(llama.runner, tok, PROMPTS, N_NEW, temperature=0, logprobs=True, echo=True)
    for text, prompt, t, lp, p, f in zip(PROMPTS, prompts, tokens, logprobs, plain, full):
        assert p["generation"] == continuation(tok, prompt, t)
        assert "tokens" not in p and "logprobs" not in p
        assert p["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(t)}
        assert p["finish_reason"] == ("length" if len(t) == N_NEW else "stop")
        assert f["generation"] == text + p["generation"]
        assert len(f["tokens"]) == len(f["logprobs"]) == len(prompt) + len(t)
        assert f["tokens"] == [tok.token_str(i) for i in prompt + t]
        assert f["logprobs"][0] == 0.0 and f["logprobs"][len(prompt):] == pytest.approx(lp, abs=1e-5)


def test_per_prompt_max_gen_len(mha):
    _, llama = mha
    tok = llama.tokenizer
    prompts = encode_all(tok)
    lengths = [3, 9, 6]
    greedy, _ = G.generate(llama.runner, prompts, max(lengths), temperature=0, tokenizer=tok)
    tokens, _ = G.generate(llama.runner, prompts, lengths, temperature=0, tokenizer=tok)
    out = G.text_completion(llama.runner, tok, PROMPTS, lengths, temperature=0)
    for prompt, n, g, t, o in zip(prompts, lengths, greedy, tokens, out):
        assert t == g[:n]
        assert o["usage"]["completion_tokens"] == len(t)
        assert o["finish_reason"] == ("length" if len(t) == n else "stop")
        assert o["generation"] == continuation(tok, prompt, t)


def test_seed_reproduces(mha):
    _, llama = mha
    tok = llama.tokenizer

    def sample(seed, prompts=PROMPTS):
        out = G.text_completion(llama.runner, tok, prompts, 12, temperature=1.0, top_p=1.0, seed=seed)
        return [o["generation"] for o in out]

    first = sample(123)
    torch.manual_seed(0)  # the global RNG plays no part when a seed is given
    assert sample(123) == first
    # a prompt's text does not depend on the other prompts of its batch
    assert sample(123, PROMPTS[::-1]) == first[::-1]
    assert sample(123, PROMPTS[1:2]) == first[1:2]
    others = [sample(s) for s in range(4)]
    assert len({tuple(o) for o in others + [first]}) > 1


def test_top_k_and_tiny_top_p(mha):
    hf, llama = mha
    tok = llama.tokenizer
    prompts = encode_all(tok)
    greedy, _ = G.generate(llama.runner, prompts, N_NEW, temperature=0, tokenizer=tok)
    top1, _ = G.generate(llama.runner, prompts, N_NEW, temperature=1.5, top_p=1.0, tokenizer=tok, top_k=1, seed=1)
    assert top1 == greedy
    for p in (1e-6, 0.0):
        tiny_p, _ = G.generate(llama.runner, prompts, N_NEW, temperature=1.5, top_p=p, tokenizer=tok, seed=1)
        assert tiny_p == greedy
    k = 3
    topk, _ = G.generate(llama.runner, prompts, N_NEW, temperature=2.0, top_p=1.0, tokenizer=tok, top_k=k, seed=2)
    assert topk != greedy
    ranks = []
    for prompt, new in zip(prompts, topk):
        lp = hf_log_probs(hf, prompt + new)[len(prompt) - 1:]
        picked = lp.gather(-1, torch.tensor(new)[:, None])
        ranks += (lp > picked + 1e-5).sum(-1).tolist()  # how many tokens were more probable
    assert max(ranks) < k, f"a token outside the top {k} was sampled: ranks {ranks}"
    assert len(set(ranks)) > 1  # and not only the most probable one


def boundary_stop(tok, prompt: list[int], tokens: list[int]) -> tuple[str, int]:
    """A stop string that straddles a token boundary inside the greedy text (so that a
    streaming client would see its first half before the second), and where it starts."""
    text = continuation(tok, prompt, tokens)
    for k in range(2, len(tokens) - 1):
        end = len(continuation(tok, prompt, tokens[:k]))
        stop = text[end - 2:end + 2]
        if (text.startswith(continuation(tok, prompt, tokens[:k])) and end > 2 and len(stop) == 4
                and text.find(stop) == end - 2 and stop.strip() == stop and "\ufffd" not in stop):
            return stop, end - 2
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings(mha):
    _, llama = mha
    tok = llama.tokenizer
    prompts = encode_all(tok)
    greedy, _ = G.generate(llama.runner, prompts, N_NEW, temperature=0, tokenizer=tok)
    stops = [boundary_stop(tok, p, g) for p, g in zip(prompts, greedy)]
    texts = [continuation(tok, p, g) for p, g in zip(prompts, greedy)]
    for i, (stop, at) in enumerate(stops):
        out = G.text_completion(llama.runner, tok, PROMPTS, N_NEW, temperature=0, stop=[stop])
        assert out[i]["generation"] == texts[i][:at]
        assert out[i]["finish_reason"] == "stop"
        assert 0 < out[i]["usage"]["completion_tokens"] < N_NEW
        for j, o in enumerate(out):  # other rows: cut at the stop if their text has it
            cut = texts[j].find(stop)
            assert o["generation"] == (texts[j] if cut < 0 else texts[j][:cut])
    # several stop strings: the earliest one cuts; a single string is one stop string
    stop, at = stops[0]
    later = next(texts[0][i:i + 3] for i in range(at + 1, len(texts[0]) - 3) if texts[0].find(texts[0][i:i + 3]) > at)
    out = G.text_completion(llama.runner, tok, PROMPTS[:1], N_NEW, temperature=0, stop=[later, stop])
    assert out[0]["generation"] == texts[0][:at]
    out = G.text_completion(llama.runner, tok, PROMPTS[:1], N_NEW, temperature=0, stop=stop)
    assert out[0]["generation"] == texts[0][:at]


# --- chat ----------------------------------------------------------------------------------

def meta_layout(tok, dialog) -> tuple[list[int], list[str]]:
    """The ids and texts of Meta's documented Llama-2 layout:
    <s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user} [/INST] {answer} </s><s>[INST] {user} [/INST]"""
    msgs = [dict(m) for m in dialog]
    if msgs[0]["role"] == "system":
        msgs = [{"role": "user", "content": f"<<SYS>>\n{msgs[0]['content']}\n<</SYS>>\n\n{msgs[1]['content']}"}] + msgs[2:]
    ids, texts = [], []
    for i in range(0, len(msgs) - 1, 2):
        text = f"[INST] {msgs[i]['content'].strip()} [/INST] {msgs[i + 1]['content'].strip()} "
        ids += [tok.bos_id] + tok.encode(text, bos=False, eos=False) + [tok.eos_id]
        texts.append(text)
    text = f"[INST] {msgs[-1]['content'].strip()} [/INST]"
    ids += [tok.bos_id] + tok.encode(text, bos=False, eos=False)
    return ids, texts + [text]


DIALOGS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Always answer with haiku."},
     {"role": "user", "content": "I am going to Paris, what should I see?"}],
    [{"role": "user", "content": "  Hello there  "},
     {"role": "assistant", "content": "General Kenobi!"},
     {"role": "user", "content": "You are a bold one."},
     {"role": "assistant", "content": " Kill him. "},
     {"role": "user", "content": "Back away, I will deal with this Jedi slime myself."}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "Bye"}],
]


@pytest.mark.parametrize("dialog", DIALOGS, ids=["user", "system", "turns", "system+turns"])
def test_encode_dialog_layout(mha, dialog):
    tok = mha[1].tokenizer
    ids = chat_format.encode_dialog(tok, dialog)
    want, texts = meta_layout(tok, dialog)
    assert ids == want
    # BOS and EOS are the special ids, one BOS per exchange and one EOS per finished one
    starts = [i for i, t in enumerate(ids) if t == tok.bos_id]
    ends = [i for i, t in enumerate(ids) if t == tok.eos_id]
    n_exchanges = sum(m["role"] == "assistant" for m in dialog)
    assert starts[0] == 0 and len(starts) == n_exchanges + 1 and len(ends) == n_exchanges
    assert ends == [s - 1 for s in starts[1:]]
    segments = [ids[s:e] for s, e in zip(starts, starts[1:] + [len(ids)])]
    norm = " ".join  # the tokenizer may normalise whitespace
    for seg, text in zip(segments, texts):
        decoded = tok.decode(seg)
        assert norm(decoded.split()) == norm(text.split())
        assert "<s>" not in decoded and "</s>" not in decoded
    system = dialog[0]["content"] if dialog[0]["role"] == "system" else None
    first = tok.decode(segments[0])
    assert first.startswith("[INST]") and tok.decode(segments[-1]).rstrip().endswith("[/INST]")
    if system:
        assert norm(first.split()).startswith(norm(f"[INST] <<SYS>> {system} <</SYS>> {dialog[1]['content']}".split()))
    else:
        assert "<<SYS>>" not in first


def msg(role, content="x"):
    return {"role": role, "content": content}


BROKEN = [
    ([], "non-empty"),
    ("hello", "non-empty"),
    ([{"role": "user"}], "'role' and 'content'"),
    (["hi"], "'role' and 'content'"),
    ([msg("robot")], "must be one of system, user, assistant"),
    ([{"role": "user", "content": 7}], "content must be a string"),
    ([msg("user", "a [INST] b")], "special tag [INST]"),
    ([msg("user", "a [/INST] b")], "special tag [/INST]"),
    ([msg("system", "<<SYS>> x"), msg("user")], "special tag <<SYS>>"),
    ([msg("user"), msg("assistant", "x <</SYS>>"), msg("user")], "special tag <</SYS>>"),
    ([msg("assistant"), msg("user")], "'assistant' where 'user' was expected"),
    ([msg("user"), msg("user")], "'user' where 'assistant' was expected"),
    ([msg("user"), msg("system"), msg("user")], "system message may only come first"),
    ([msg("system"), msg("system"), msg("user")], "system message may only come first"),
    ([msg("system"), msg("assistant")], "roles must alternate"),
    ([msg("user"), msg("assistant")], "must end with a user message"),
    ([msg("system")], "must end with a user message"),
]


@pytest.mark.parametrize("dialog, message", BROKEN, ids=[m for _, m in BROKEN])
def test_broken_dialogs_raise(mha, dialog, message):
    _, llama = mha
    with pytest.raises(ValueError) as err:
        chat_format.encode_dialog(llama.tokenizer, dialog)
    assert message in str(err.value)
    good = [msg("user", "fine")]
    with pytest.raises(ValueError, match="dialog"):  # a whole batch is refused before any work
        G.chat_completion(llama.runner, llama.tokenizer, [good, dialog], 4, temperature=0)


def test_broken_dialog_messages_are_distinct(mha):
    tok = mha[1].tokenizer
    messages = set()
    for dialog, _ in BROKEN:
        with pytest.raises(ValueError) as err:
            chat_format.encode_dialog(tok, dialog)
        messages.add(str(err.value))
    assert len(messages) >= 12


def test_chat_completion(mha):
    _, llama = mha
    tok = llama.tokenizer
    dialogs = DIALOGS[:3]
    prompts = [chat_format.encode_dialog(tok, d) for d in dialogs]
    tokens, logprobs = G.generate(llama.runner, prompts, 8, temperature=0, logprobs=True, tokenizer=tok)
    out = G.chat_completion(llama.runner, tok, dialogs, 8, temperature=0, logprobs=True)
    for o, p, t, lp in zip(out, prompts, tokens, logprobs):
        assert o["generation"] == {"role": "assistant", "content": tok.decode(t)}  # the message alone
        assert o["usage"] == {"prompt_tokens": len(p), "completion_tokens": len(t)}
        assert o["tokens"] == [tok.token_str(i) for i in t] and o["logprobs"] == lp


# --- Engine: continuous batching -------------------------------------------------------------

def greedy(n=N_NEW, **kw):
    return sequence.SamplingParams(max_gen_len=n, temperature=0, **kw)


def test_engine_staggered_sequences_match_running_alone(mha):
    """Sequences that join and leave at different times, more of them than max_seqs (the
    last one waits for room), one sampled with a seed, one sharing a prompt (and so its
    cached blocks) with another: each gets the tokens it gets alone, and every block comes
    back to the pool."""
    _, llama = mha
    tok = llama.tokenizer
    prompts = encode_all(tok, PROMPTS + ["Another prompt, of yet another length, for the fourth sequence"])
    lengths = [N_NEW, N_NEW, 12, N_NEW]
    alone = [G.generate(llama.runner, [p], n, temperature=0, tokenizer=tok)[0][0] for p, n in zip(prompts, lengths)]
    # and a sampled sequence with a seed, which must not care about its neighbours either
    sampled_params = dict(max_gen_len=N_NEW, temperature=1.0, top_p=1.0, seed=11)
    sampled_alone = G.generate(llama.runner, [prompts[2]], N_NEW, 1.0, 1.0, tokenizer=tok, seed=11)[0][0]

    eng = Engine(llama.runner, tok)
    a = eng.add(prompts[0], greedy(lengths[0]))
    for _ in range(3):
        eng.step()
    b = eng.add(prompts[1], greedy(lengths[1]))
    eng.step()
    eng.step()
    c = eng.add(prompts[2], greedy(lengths[2]))
    for _ in range(4):
        eng.step()
    # a leaves while running: it is no longer stepped
    a_tokens = list(a.tokens)
    eng.release(a)
    assert a not in eng.running
    d = eng.add(prompts[3], greedy(lengths[3]))
    s = eng.add(prompts[2], sequence.SamplingParams(**sampled_params))
    e = eng.add(prompts[1], greedy())  # a fifth sequence: it waits until one of the four ends
    eng.step()
    assert e in eng.scheduler.waiting and len(eng.scheduler.running) == MAX_BATCH
    eng.release(b)
    while eng.running:
        eng.step()
    assert a.tokens == a_tokens and a_tokens == alone[0][:len(a_tokens)] and len(a_tokens) == 9
    assert b.tokens == alone[1][:len(b.tokens)] and len(b.tokens) == 7
    assert c.tokens == alone[2] and d.tokens == alone[3] and s.tokens == sampled_alone and e.tokens == alone[1]
    assert c.finish_reason == ("length" if len(c.tokens) == lengths[2] else "stop")
    for seq in (c, d, s, d):  # releasing twice is harmless
        eng.release(seq)
    assert eng.pool.num_used == 0 and not eng.running


def stream(eng, seq, moments=None) -> list[str]:
    """Run seq to the end, taking new_text() after every step; check every moment, and
    record (text so far, text emitted so far) in moments."""
    pieces = [seq.new_text()]
    while not seq.done:
        eng.step()
        pieces.append(seq.new_text())
        assert seq.text.startswith("".join(pieces)), "emitted text that is not in the final text"
        if moments is not None:
            moments.append((seq.text, "".join(pieces)))
    pieces.append(seq.new_text())
    assert pieces[-1] == "" and seq.new_text() == ""
    return pieces


def test_new_text_streams_without_stop_prefixes(mha):
    _, llama = mha
    tok = llama.tokenizer
    prompts = encode_all(tok)
    greedy_tokens, _ = G.generate(llama.runner, prompts, N_NEW, temperature=0, tokenizer=tok)
    eng = Engine(llama.runner, tok)
    for prompt, g in zip(prompts, greedy_tokens):
        full = continuation(tok, prompt, g)
        stop, at = boundary_stop(tok, prompt, g)
        seq = eng.add(prompt, greedy(stop=(stop,)))
        moments = []
        pieces = stream(eng, seq, moments)
        assert "".join(pieces) == seq.text == full[:at]
        assert seq.finish_reason == "stop"
        # the first half of the stop string came with a token before the one that completed
        # it, and was held back then
        assert (full[:at + 2], full[:at]) in [(text, emitted[:at]) for text, emitted in moments]
        eng.release(seq)
        seq = eng.add(prompt, greedy())
        assert "".join(stream(eng, seq)) == seq.text == full
        eng.release(seq)


class ScriptedRunner:
    """A stand-in for the ModelRunner whose next token depends only on the position:
    the logits at position q put all the weight on script[q]."""

    def __init__(self, script: dict[int, int], vocab: int, fill: int):
        self.script, self.vocab, self.fill = script, vocab, fill
        self.max_batch_size, self.max_seq_len, self.device = 2, 128, torch.device("cpu")
        self.num_blocks, self.block_size, self.vocab_size = 16, 16, vocab

    def forward_batch(self, batch):
        rows = range(len(batch.tokens)) if batch.logits_at is None else batch.logits_at
        logits = torch.zeros(len(rows), self.vocab)
        for i, row in enumerate(rows):
            logits[i, self.script.get(batch.positions[row], self.fill)] = 10.0
        return logits


def test_new_text_holds_back_unfinished_characters(mha):
    """Characters of several bytes come as several byte tokens (byte fallback); a partial
    one decodes to one U+FFFD per byte. None of those may be streamed."""
    tok = mha[1].tokenizer
    text = "ab 日本語 😀 ok ü"
    ids = tok.encode(text, bos=False, eos=False)
    prompt = [tok.bos_id]
    script = {len(prompt) - 1 + i: t for i, t in enumerate(ids + [tok.eos_id])}
    eng = Engine(ScriptedRunner(script, tok.n_words, tok.eos_id), tok)
    seq = eng.add(prompt, greedy(n=len(ids) + 5))
    pieces = stream(eng, seq)
    assert seq.tokens == ids and seq.finish_reason == "stop"
    assert "".join(pieces) == seq.text == continuation(tok, prompt, ids)
    if "\ufffd" not in seq.text:
        assert not any("\ufffd" in p for p in pieces), pieces


def naive_held_back(text: str, stops: tuple[str, ...]) -> int:
    """The definition: the longest end of text, shorter than the longest stop string, that
    some stop string starts with."""
    for k in range(min(max(map(len, stops)) - 1, len(text)), 0, -1):
        if any(stop.startswith(text[-k:]) for stop in stops):
            return k
    return 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text("ab", min_size=1, max_size=8), min_size=1, max_size=4),
       st.lists(st.text("abc", max_size=6), max_size=12))
def test_stop_ends_hold_back_what_the_definition_does(stops, pieces):
    """StopEnds, fed piece by piece (whole stop strings among them, as before min_tokens),
    holds back at every moment what the definition says of the whole text."""
    ends, text = sequence.StopEnds(tuple(stops)), ""
    for piece in pieces:
        ends.feed(piece)
        text += piece
        assert ends.held_back() == naive_held_back(text, tuple(stops)), (text, stops)


def test_stop_ends_cost_grows_with_the_new_text_alone():
    """Feeding a character costs the same however long the stop strings and the text: 16
    stop strings of 512 characters (the limit), 8,000 characters fed one at a time, in
    steps of the automaton counted through a str subclass (no timing)."""
    stops = tuple("a" * 511 + chr(ord("b") + i) for i in range(16))  # each a near-match of a run of a's
    ends = sequence.StopEnds(stops)
    for _ in range(8000):
        ends.feed("a")
    assert ends.held_back() == 511
    compared = 0

    class Counting(str):
        def __getitem__(self, i):
            nonlocal compared
            compared += 1
            return str.__getitem__(self, i)

    ends.stops = tuple(Counting(s) for s in stops)
    ends.feed("a")
    assert compared <= 16 * 3  # a few comparisons per stop string, not hundreds
