"""lm-eval (`lm_eval`, its `local-completions` model) against our server and vLLM's on the same
tiny random checkpoint: a loglikelihood task and a generate-until task, each a task YAML over a
local JSONL (no hub). lm-eval's loglikelihood requests are `echo: true, logprobs: 1,
max_tokens: 1`, so this is the echo path end to end.

References: transformers' teacher-forced log-probs on the same weights (each sample's
loglikelihood and is-greedy), and vLLM's replies to the same requests (the same numbers and the
same generated text). Without the vLLM server venv the vLLM half is skipped with the reason
(under CI=true a missing venv is a failure, as in vllm_server_test.py).
"""

import json
import os

import numpy as np
import pytest

from mmr_jax.rollout import vllm_launch
from mmr_jax.serving import embedded_backend, server

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm_server")]
lm_eval = pytest.importorskip("lm_eval")
torch = pytest.importorskip("torch")

ROWS = [
    {"question": "2 + 3 =", "choices": [" 5", " 6", " 7"], "answer": 0},
    {"question": "The sky is", "choices": [" blue", " green"], "answer": 0},
    {"question": "10 - 4 =", "choices": [" 6", " 4", " 14"], "answer": 0},
]
LOGLIK_YAML = """task: tiny_loglik
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_YAML = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from support import testing

    root = tmp_path_factory.mktemp("lm_eval_tiny")
    return testing.make_tiny_checkpoint(root / "tiny", seed=0, hidden_size=128, head_dim=32)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (root / "tiny_loglik.yaml").write_text(LOGLIK_YAML.format(data=data))
    (root / "tiny_gen.yaml").write_text(GEN_YAML.format(data=data))
    return root


@pytest.fixture(scope="module")
def ours(ckpt):
    backend = embedded_backend.EmbeddedBackend.from_pretrained(ckpt, model_name="tiny")
    with server.OpenAIServer(backend) as srv:
        yield srv.url


@pytest.fixture(scope="module")
def vllm_url(ckpt, tmp_path_factory):
    try:
        python = vllm_launch.venv_python()
    except vllm_launch.ServerStartError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must build the vLLM server venv first: {e}")
        pytest.skip(f"no vLLM server venv: {e}")
    opts = vllm_launch.LaunchOptions(
        model=str(ckpt), served_model_name="tiny", port=vllm_launch.free_port(),
        python=str(python), backend="cpu", dtype="float32", max_model_len=512,
    )  # fmt: skip
    proc = vllm_launch.ServerProcess(opts, tmp_path_factory.mktemp("vllm") / "server.log").start()
    try:
        proc.wait_ready(timeout_s=900)
        yield proc.url
    finally:
        proc.stop()


def _evaluate(url, ckpt, tasks_dir, task):
    """lm-eval's per-sample records of `task` through local-completions at `url`."""
    from lm_eval.tasks import TaskManager

    args = f"model=tiny,base_url={url}/v1/completions,tokenizer_backend=huggingface,"
    args += f"tokenizer={ckpt},num_concurrent=1,max_retries=1,tokenized_requests=False"
    out = lm_eval.simple_evaluate(
        model="local-completions", model_args=args, tasks=[task],
        task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True,
    )  # fmt: skip
    return out["samples"][task]


def _reference(ckpt, samples):
    """Per sample, per choice: (sum of the continuation's log-probs, is greedy), transformers."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    out = []
    for s in samples:
        per = []
        for context, cont in s["arguments"]:
            ctx, whole = tok.encode(context), tok.encode(context + cont)
            with torch.no_grad():
                logps = torch.log_softmax(model(torch.tensor([whole])).logits[0], -1).numpy()
            at = range(len(ctx), len(whole))
            per.append(
                (
                    sum(logps[t - 1, whole[t]] for t in at),
                    all(logps[t - 1].argmax() == whole[t] for t in at),
                )
            )
        out.append(per)
    return out


def _loglik(samples):
    return [[(float(r[0][0]), bool(r[0][1])) for r in s["resps"]] for s in samples]


def test_loglikelihood_task_equals_transformers(ours, ckpt, tasks):
    samples = _evaluate(ours, ckpt, tasks, "tiny_loglik")
    assert len(samples) == len(ROWS)
    ref = _reference(ckpt, samples)
    got = _loglik(samples)
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose([x[0] for x in g], [x[0] for x in r], atol=1e-3)
        assert [x[1] for x in g] == [x[1] for x in r]


def test_generate_until_task_runs_through_completions(ours, ckpt, tasks):
    import requests

    samples = _evaluate(ours, ckpt, tasks, "tiny_gen")
    for s in samples:  # lm-eval's text is the server's greedy text, cut at its "\n"
        context = s["arguments"][0][0]
        body = {"model": "tiny", "prompt": context, "max_tokens": 8, "temperature": 0}
        body["stop"] = ["\n"]
        want = requests.post(f"{ours}/v1/completions", json=body, timeout=60).json()
        assert s["resps"][0][0] == want["choices"][0]["text"]


def test_both_tasks_answer_as_vllm(ours, vllm_url, ckpt, tasks):
    a, b = (_evaluate(u, ckpt, tasks, "tiny_loglik") for u in (ours, vllm_url))
    for x, y in zip(_loglik(a), _loglik(b), strict=True):
        np.testing.assert_allclose([v[0] for v in x], [v[0] for v in y], atol=1e-3)
        assert [v[1] for v in x] == [v[1] for v in y]
    a, b = (_evaluate(u, ckpt, tasks, "tiny_gen") for u in (ours, vllm_url))
    assert [s["resps"] for s in a] == [s["resps"] for s in b]
