"""generate.py under torchrun with tensor parallelism (TP=2, gloo on CPU): greedy tokens
and logprobs equal transformers' on the same weights, and every rank ends up with the
same tokens whatever the sampling settings, although each rank's RNG is seeded
differently (rank 0's tokens are broadcast)."""

import json

import pytest
import torch

from test_generate import MAX_BATCH, MAX_SEQ_LEN, N_NEW, PROMPTS, chosen, hf_greedy, hf_log_probs
from torchrun import run

pytestmark = pytest.mark.slow  # torchrun ranks


@pytest.mark.parametrize("name, layout", [("mha", "hf"), ("gqa", "meta:2")])
def test_tp2_generation(checkpoints, tmp_path, name, layout):
    hf, folders = checkpoints[name]
    spec = {"folder": folders[layout], "prompts": PROMPTS, "n_new": N_NEW,
            "max_batch_size": MAX_BATCH, "max_seq_len": MAX_SEQ_LEN}
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    results = run("generate_worker.py", 2, tmp_path, spec_path)
    assert [r["rank"] for r in results] == [0, 1] and all(r["world_size"] == 2 for r in results)
    r0, r1 = results

    # every rank has exactly the same tokens, texts and logprobs
    for key in r0:
        if key != "rank":
            assert r0[key] == r1[key], f"ranks disagree on {key}"

    from tokenizer import Tokenizer
    tok = Tokenizer(f"{folders[layout]}/tokenizer.model")
    prompts = [tok.encode(p, bos=True, eos=False) for p in PROMPTS]
    for i, prompt in enumerate(prompts):
        new = r0["greedy"][i]
        assert new == hf_greedy(hf, prompt, N_NEW, tok.eos_id)
        ref = chosen(hf_log_probs(hf, prompt + new), prompt + new)
        torch.testing.assert_close(torch.tensor(r0["greedy_logprobs"][i]), ref[len(prompt) - 1:], atol=1e-4, rtol=0)
        assert r0["echo"][i] == prompt + new and r0["echo_logprobs"][i][0] == 0.0
        torch.testing.assert_close(torch.tensor(r0["echo_logprobs"][i][1:]), ref, atol=1e-4, rtol=0)
        # sampled logprobs are the model's (reference) ones for the tokens rank 0 chose
        s = r0["sampled"][i]
        ref = chosen(hf_log_probs(hf, prompt + s), prompt + s)[len(prompt) - 1:]
        torch.testing.assert_close(torch.tensor(r0["sampled_logprobs"][i]), ref, atol=1e-4, rtol=0)

    # the sampled runs really sampled: otherwise rank agreement would prove nothing
    assert r0["sampled"] != r0["greedy"]
    assert r0["text_sampled"] != [tok.decode(t) for t in r0["greedy"]]
    assert r0["engine_sampled"] != r0["greedy"]
