"""lm-evaluation-harness (the pinned lm-eval) against the tests' TorchServe, as users run it
against vLLM: `local-completions` with the remote tokenizer (vLLM's tokenizer_info and
tokenize routes) on a multiple-choice task, and `generate_until` tasks through
`local-completions` and `local-chat-completions`. The tasks are local files written here;
nothing is downloaded. Every loglikelihood, generation and score equals the demo model's
in this process."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

import generate as G
import sequence
from engine import Engine

MC = [  # (question, choices, gold)
    ("The secret of a happy life is", ["to be a man", "a cat in a box", "money"], 0),
    ("Once upon a time there was a", ["king", "woman who lived in a shoe", "banana"], 1),
    ("A good friend is", ["hard to find", "a spoon", "purple"], 0),
    ("Never put off until tomorrow what", ["you can do today", "the cat ate", "seven"], 0),
    ("Love is", ["blind", "a table", "the square root of two"], 2),
]
GEN = ["The secret of a happy life is", "Once upon a time", "A good friend is"]
MAX_GEN = 8


def write_tasks(folder: str, targets: list[str]):
    def jsonl(name: str, rows: list[dict]) -> str:
        path = os.path.join(folder, name)
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        return path

    mc = jsonl("mc.jsonl", [{"question": q, "choices": c, "gold": g} for q, c, g in MC])
    gen = jsonl("gen.jsonl", [{"prompt": p, "target": t} for p, t in zip(GEN, targets)])
    common = "test_split: test\ndataset_path: json\n"
    with open(os.path.join(folder, "tiny_mc.yaml"), "w") as f:
        f.write(f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {mc}\n"
                "output_type: multiple_choice\ndoc_to_text: question\ndoc_to_choice: choices\ndoc_to_target: gold\n"
                "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    with open(os.path.join(folder, "tiny_gen.yaml"), "w") as f:
        f.write(f"task: tiny_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {gen}\n"
                "output_type: generate_until\ndoc_to_text: prompt\ndoc_to_target: target\n"
                f"generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: {MAX_GEN}\n  do_sample: false\n"
                "  temperature: 0\n"
                "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")


@pytest.fixture(scope="module")
def lm_eval_env(tmp_path_factory, server):
    """lm_eval, with its caches in a temporary folder and the hub off."""
    home = tmp_path_factory.mktemp("hf_home")
    saved = {k: os.environ.get(k) for k in ("HF_HOME", "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "OPENAI_API_KEY")}
    os.environ.update(HF_HOME=str(home), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OPENAI_API_KEY=server.key)
    import lm_eval
    from lm_eval.tasks import TaskManager

    yield lm_eval, TaskManager
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def continuation_logprob(llama, context: str, continuation: str) -> float:
    """lm-eval's loglikelihood, computed here: context and continuation tokenized as its
    TemplateLM does (trailing spaces of the context move to the continuation; no BOS, as the
    remote tokenizer sends none), then the sum of log_softmax over the continuation."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    tok = llama.tokenizer
    whole = tok.encode(context + continuation, bos=False, eos=False)
    n_context = len(tok.encode(context, bos=False, eos=False))
    logits = llama.runner(torch.tensor([whole]), 0, slot=0)[0].float()
    logprobs = F.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(whole[1:])[:, None])[:, 0]
    return logprobs[n_context - 1:].sum().item()


def greedy_text(llama, prompt_tokens: list[int], stop: tuple[str, ...]) -> str:
    engine = Engine(llama.runner, llama.tokenizer)
    params = sequence.SamplingParams(max_gen_len=MAX_GEN, temperature=0, stop=stop)
    return G.run_to_completion(engine, [prompt_tokens], [params])[0].text


def test_lm_eval_local_completions(server, demo_llama, lm_eval_env, tmp_path):
    lm_eval, TaskManager = lm_eval_env
    tok = demo_llama.tokenizer
    # generation targets: the in-process answer for the first prompt, so exact_match is 1/3
    # when the server answers as this process does
    expected = [greedy_text(demo_llama, tok.encode(p, bos=False, eos=False), ("\n", "</s>")) for p in GEN]
    write_tasks(str(tmp_path), [expected[0], "no", "no"])
    base = f"{server.url}/predictions/llama/1.0"
    args = (f"model=llama,base_url={base}/v1/completions,tokenizer_backend=remote,auth_token={server.key},"
            "max_length=512,max_retries=1,num_concurrent=1,timeout=120")
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["tiny_mc", "tiny_gen"],
                                  task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False), log_samples=True,
                                  batch_size=1)
    samples = sorted(out["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(MC)
    diffs, correct = [], []
    for sample, (question, choices, gold) in zip(samples, MC):
        got = [r[0][0] for r in sample["resps"]]
        want = [continuation_logprob(demo_llama, question, " " + c) for c in choices]
        diffs += [abs(g - w) for g, w in zip(got, want)]
        correct.append(max(range(len(want)), key=want.__getitem__) == gold)
    print(f"lm-eval loglikelihoods: {len(diffs)}, max |server - in-process| = {max(diffs):.2e}")
    assert max(diffs) < 1e-4
    acc = out["results"]["tiny_mc"]["acc,none"]
    assert acc == pytest.approx(sum(correct) / len(correct), abs=1e-4) and 0 < acc < 1

    gens = sorted(out["samples"]["tiny_gen"], key=lambda s: s["doc_id"])
    assert [s["filtered_resps"][0] for s in gens] == expected
    assert out["results"]["tiny_gen"]["exact_match,none"] == pytest.approx(1 / 3)


def test_lm_eval_local_chat_completions(server, demo_llama, lm_eval_env, tmp_path):
    lm_eval, TaskManager = lm_eval_env
    dialogs = [[{"role": "user", "content": p}] for p in GEN]
    expected = [a["generation"]["content"] for a in
                demo_llama.chat_completion(dialogs, MAX_GEN, temperature=0, stop=["\n"])]
    write_tasks(str(tmp_path), [expected[0], "no", "no"])
    args = (f"model=llama,base_url={server.url}/predictions/llama/1.0/v1/chat/completions,max_retries=1,"
            "num_concurrent=1,timeout=120")
    out = lm_eval.simple_evaluate(model="local-chat-completions", model_args=args, tasks=["tiny_gen"],
                                  task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False), log_samples=True,
                                  apply_chat_template=True, batch_size=1)
    gens = sorted(out["samples"]["tiny_gen"], key=lambda s: s["doc_id"])
    assert [json.loads(s["arguments"][0][0][0]) for s in gens] == dialogs  # the messages sent
    assert [s["filtered_resps"][0] for s in gens] == expected
    assert out["results"]["tiny_gen"]["exact_match,none"] == pytest.approx(1 / 3)
