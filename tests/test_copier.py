"""tools/copier.py, the speculative-decoding bench's model that quotes its prompt: it goes on
with a passage it has seen, and where nothing it has seen matches, its text does not repeat."""

import pytest

import copier
import llama2
from engine import Engine
from sequence import SamplingParams

from conftest import TOKENIZER

PASSAGE = ("The committee met on Tuesday to review the budget. After a long discussion, the members agreed to "
           "fund the new library, repair the bridge on Mill Street, and hire two more teachers.")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tokenizer import Tokenizer
    tokenizer = Tokenizer(TOKENIZER)
    folder = copier.write(str(tmp_path_factory.mktemp("copier")), 512, 2, 8, tokenizer.n_words, tokenizer.bos_id)
    return llama2.tp_llama(None, folder, TOKENIZER, 1, max_batch_size=2, max_seq_len=256)


def greedy(llama, prompt: str, n: int) -> list[int]:
    engine = Engine(llama.runner, llama.tokenizer, threaded=False)
    seq = engine.add(llama.tokenizer.encode(prompt, bos=True, eos=False),
                     SamplingParams(max_gen_len=n, temperature=0.0, ignore_eos=True))
    while engine.running:
        engine.step()
    return seq.tokens


def test_the_copier_goes_on_with_a_passage_from_its_prompt(llama):
    start = "The committee met on Tuesday to review the"
    passage = llama.tokenizer.encode(PASSAGE, bos=False, eos=False)
    n = len(llama.tokenizer.encode(start, bos=False, eos=False))
    assert greedy(llama, f"{PASSAGE}\nAgain:\n{start}", 30) == passage[n:n + 30]


def test_the_copier_does_not_repeat_itself_where_nothing_matches(llama):
    tokens = greedy(llama, "Once upon a time", 60)
    trigrams = [tuple(tokens[i:i + 3]) for i in range(len(tokens) - 2)]
    assert len(set(trigrams)) == len(trigrams)
