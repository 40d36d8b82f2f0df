"""mmr_jax.distributed on its own: start-up options and errors, shares, the vLLM server of each
process, gathers and metric reductions, and each process scoring its own share of a generation
round (`experience.generate_and_score`), in one process and in a real 2-process CPU cluster.

The training runs over several processes (the contract, faults) are
tests/end_to_end/multihost_test.py."""

import json
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from mmr_jax import distributed
from mmr_jax.infra import metrics
from mmr_jax.rollout import base as rollout_base
from mmr_jax.step import experience

from support import multihost

REPO = pathlib.Path(__file__).resolve().parents[2]

# A limit on the subprocesses below only ends a hang: a start-up (JAX imports, a cluster of 2)
# takes 5-20 s on 2 idle cores and several times that beside a whole test run, so no bound on a
# busy machine's speed belongs here. The bounds the tests assert are their own.
_SUBPROCESS_S = 600


class TestShare:
    @pytest.mark.parametrize("num,processes", [(8, 2), (7, 3), (2, 4), (0, 2), (5, 1)])
    def test_contiguous_cover(self, num, processes):
        parts = [distributed.share(num, processes, i) for i in range(processes)]
        covered = [j for p in parts for j in range(num)[p]]
        assert covered == list(range(num))  # in order, each item once
        sizes = [p.stop - p.start for p in parts]
        assert max(sizes) - min(sizes) <= 1

    def test_index_out_of_range(self):
        with pytest.raises(distributed.ProcessIdError):
            distributed.share(4, 2, 2)


class TestOptions:
    def test_no_flags_is_one_process(self):
        opts = distributed.options_from_flags(
            distributed="off", coordinator_address=None, num_processes=None, process_id=None
        )
        assert opts.mode == "off" and not distributed.initialize(opts)

    @pytest.mark.parametrize("pid,n", [(2, 2), (-1, 2), (0, 0)])
    def test_process_id_out_of_range(self, pid, n):
        with pytest.raises(distributed.ProcessIdError, match="process"):
            distributed.options_from_flags(
                distributed="off",
                coordinator_address="localhost:1",
                num_processes=n,
                process_id=pid,
            )

    def test_partial_flags(self):
        with pytest.raises(ValueError, match="go together"):
            distributed.options_from_flags(
                distributed="off", coordinator_address="h:1", num_processes=2, process_id=None
            )

    def test_bad_address(self):
        with pytest.raises(ValueError, match="HOST:PORT"):
            distributed.options_from_flags(
                distributed="off", coordinator_address="nohostport", num_processes=2, process_id=0
            )

    def test_unreachable_coordinator_in_bounded_time(self):
        t0 = time.monotonic()
        with pytest.raises(distributed.CoordinatorUnreachableError, match="no coordinator"):
            distributed.wait_for_coordinator(f"localhost:{multihost.free_port()}", 2.0)
        assert time.monotonic() - t0 < 10

    def test_batch_split(self):
        distributed.check_batch_split(4, 2)
        with pytest.raises(distributed.BatchSplitError, match="multiple of 2"):
            distributed.check_batch_split(3, 2)

    def test_config_digest(self):
        a = distributed.config_digest({"x": 1, "y": {"z": [1, 2]}})
        assert a == distributed.config_digest({"y": {"z": [1, 2]}, "x": 1})  # order-free
        assert a != distributed.config_digest({"x": 1, "y": {"z": [1, 3]}})


class TestTrainScriptFlags:
    """scripts/train.py refuses bad start-up flags with a named error (no JAX cluster needed)."""

    def _train(self, *flags, timeout=_SUBPROCESS_S):
        args = [sys.executable, str(REPO / "scripts/train.py"), "--config=configs/grpo.py:smoke"]
        return subprocess.run(
            [*args, "--workdir=/tmp/unused_multihost", *flags],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
            env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
        )

    def test_process_id_out_of_range(self):
        r = self._train("--coordinator_address=localhost:1", "--num_processes=2", "--process_id=2")
        assert r.returncode != 0 and "ProcessIdError" in r.stderr, r.stderr[-2000:]

    def test_unreachable_coordinator(self):
        port = multihost.free_port()
        t0 = time.monotonic()
        r = self._train(
            f"--coordinator_address=localhost:{port}",
            "--num_processes=2",
            "--process_id=1",
            "--distributed_timeout_s=3",
        )
        assert r.returncode != 0 and "CoordinatorUnreachableError" in r.stderr, r.stderr[-2000:]
        assert time.monotonic() - t0 < 60


class TestOneWriter:
    """What processes other than 0 get: a writer that writes nothing, a console without stdout."""

    def test_null_writer_writes_nothing(self, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        w = metrics.NullWriter()
        assert w.write(3, {"loss": np.float32(0.5), "name": "x"}) == {"loss": 0.5}
        w.write_text(3, "sample", "text")
        w.close()
        assert list(tmp_path.iterdir()) == []

    def test_console_without_stdout(self, tmp_path):
        script = (
            "import sys; from mmr_jax.infra import console; "
            "console.setup(sys.argv[1], stdout=sys.argv[2] == '1'); console.info('hello %d', 7)"
        )
        for shown in ("1", "0"):
            log = tmp_path / f"run{shown}.log"
            r = subprocess.run(
                [sys.executable, "-c", script, str(log), shown],
                capture_output=True,
                text=True,
                cwd=REPO,
                timeout=_SUBPROCESS_S,
            )
            assert r.returncode == 0, r.stderr
            assert ("hello 7" in r.stdout) == (shown == "1")
            assert "hello 7" in log.read_text()  # the log file has it either way


class TestRolloutUrl:
    def test_one_url_serves_every_process(self):
        assert [distributed.rollout_url("http://h:8000", 3, i) for i in range(3)] == [
            "http://h:8000"
        ] * 3
        assert distributed.rollout_url("", 2, 1) == ""  # each process launches its own server

    def test_one_url_per_process(self):
        urls = "http://a:8000, http://b:8000"
        assert distributed.rollout_url(urls, 2, 0) == "http://a:8000"
        assert distributed.rollout_url(urls, 2, 1) == "http://b:8000"

    @pytest.mark.parametrize(
        "urls,processes", [("a,b,c", 2), ("a,b", 1), ("a,b", 3), ("a,", 2), (",", 2)]
    )
    def test_other_lengths_are_named_errors(self, urls, processes):
        with pytest.raises(distributed.RolloutUrlError, match="one per process"):
            distributed.rollout_url(urls, processes, 0)


class TestGatherRows:
    def test_one_process_round_trip(self):
        rng = np.random.default_rng(0)
        local = {
            "f": rng.standard_normal((3, 2, 4)).astype(np.float32),
            "i": rng.integers(-5, 5, (3,)).astype(np.int32),
            "b": rng.random((3, 2)) < 0.5,
        }
        specs = {"f": ((2, 4), np.float32), "i": ((), np.int32), "b": ((2,), np.bool_)}
        out = distributed.gather_rows(local, sizes=[3], specs=specs)
        for k, v in local.items():
            assert out[k].dtype == v.dtype
            np.testing.assert_array_equal(out[k], v)  # bit-exact, float32 included

    def test_refuses_other_dtypes(self):
        with pytest.raises(TypeError, match="float64"):
            distributed.gather_rows({"x": np.zeros((1,))}, sizes=[1], specs={"x": ((), np.float64)})


# A generation round scored in one process and in two (tests/distributed/distributed_test.py's
# 2-process script below): a deterministic engine, tokenizer, reward and encoder that count their
# calls.
ROUND_PROMPTS = [[3, 1, 4], [1, 5], [9, 2, 6, 5], [3, 5]]
ROUND_ANSWERS = ["7", "12", "", "4"]  # "": an unparseable gold (valid False)
ROUND_PARAMS = rollout_base.SamplingParams(max_new_tokens=6, n=3, seed=5)
ROUND_WEIGHTS = {"test_count": 1.0, "format": 0.5}


class RowEngine:
    """Completion r of a call (r counts from `first_row`) depends on its prompt and r only."""

    pad_id = 0

    def generate(self, prompt_ids, params, *, first_row=0):
        toks, lps, reasons = [], [], []
        for b, p in enumerate(prompt_ids):
            rows = [[], [], []]
            for i in range(params.n):
                r = first_row + b * params.n + i
                length = 1 + (sum(p) + 3 * r) % params.max_new_tokens
                rows[0].append([(sum(p) + 7 * r + k) % 40 + 1 for k in range(length)])
                rows[1].append([-0.01 * (k + 1) - 0.001 * r for k in range(length)])
                rows[2].append("length" if length == params.max_new_tokens else "stop")
            toks.append(rows[0]), lps.append(rows[1]), reasons.append(rows[2])
        return rollout_base.batch_from_lists(toks, lps, reasons)


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(t % 10) if t % 3 else " ab"[t % 3 + (t % 2)] for t in ids)


class CountingEncoder:
    """The hashing encoder, counting the texts it embeds."""

    def __init__(self):
        from mmr_jax.step import embeddings

        self.inner, self.texts = embeddings.make_encoder("hashing"), 0
        self.dim = self.inner.dim

    def encode(self, texts):
        self.texts += len(texts)
        return self.inner.encode(texts)


SCORED = []  # completions scored by the 'test_count' reward, per call


def register_counting_reward():
    from mmr_jax import rewards

    if "test_count" in rewards.REGISTRY:
        return

    @rewards.register("test_count")
    def _count(completions, answers, *, lengths=None):
        """The share of digits in each completion; records how many completions it scored."""
        del answers, lengths
        SCORED.append(len(completions))
        return np.array([sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions])


def score_round(engine, encoder) -> experience.Groups:
    register_counting_reward()
    return experience.generate_and_score(
        engine, CharTokenizer(), ROUND_PROMPTS, ROUND_ANSWERS, ROUND_PARAMS, ROUND_WEIGHTS,
        encoder=encoder,
    )  # fmt: skip


def groups_json(g: experience.Groups) -> dict:
    return {
        "tokens": g.tokens.tolist(), "mask": g.mask.tolist(),
        "logps": g.sampler_logps.view(np.int32).tolist(), "truncated": g.truncated.tolist(),
        "texts": [list(t) for t in g.texts], "per_fn": {k: v.tolist() for k, v in g.per_fn.items()},
        "total": g.total.view(np.int32).tolist(), "valid": g.valid.tolist(),
        "embeddings": g.embeddings.view(np.int32).tolist(),
    }  # fmt: skip


class TestScoreRoundOneProcess:
    def test_share_engine_of_one_process_is_the_engine(self):
        """With one process the share is the whole batch: the same groups as the engine's."""
        a = groups_json(score_round(RowEngine(), CountingEncoder()))
        b = groups_json(score_round(distributed.ShareEngine(RowEngine()), CountingEncoder()))
        assert a == b
        assert 0 < np.mean(a["valid"]) < 1 and len(set(np.ravel(a["per_fn"]["test_count"]))) > 2


def _rollout(b, n, t, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, (b, n))
    mask = np.arange(t)[None, None] < lengths[..., None]
    return rollout_base.RolloutBatch(
        tokens=np.where(mask, rng.integers(1, 50, (b, n, t)), 0).astype(np.int32),
        mask=mask,
        logprobs=np.where(mask, -rng.random((b, n, t)), 0).astype(np.float32),
        finish_reasons=np.where(lengths == t, "length", "stop").tolist(),
    )


class TestGatherOneProcess:
    def test_identity(self):
        batch = _rollout(3, 2, 5, 0)
        out = distributed.gather_rollouts(batch, sizes=[3], n=2, max_len=8)
        t = int(batch.mask.sum(-1).max())
        assert out.tokens.shape == (3, 2, t)  # trimmed to the longest completion
        np.testing.assert_array_equal(out.tokens, batch.tokens[..., :t])
        np.testing.assert_array_equal(out.logprobs, batch.logprobs[..., :t])  # bit-exact
        np.testing.assert_array_equal(out.mask, batch.mask[..., :t])
        assert out.finish_reasons == batch.finish_reasons

    def test_reduce_metrics_one_process(self):
        assert distributed.reduce_metrics({"a": 1.5, "time/x": 2.0}) == {"a": 1.5, "time/x": 2.0}


_GATHER_SCRIPT = """
import sys, json, numpy as np
from mmr_jax import distributed
from mmr_jax.rollout import base
sys.path[:0] = ["tests", "tests/distributed"]
import distributed_test as t
pid = int(sys.argv[1])
distributed.initialize(distributed.Options("explicit", sys.argv[2], 2, pid, 60))
# Process 0 holds 2 prompts of 3 tokens, process 1 one prompt of 5 tokens.
local = t._rollout(2, 3, 3, 0) if pid == 0 else t._rollout(1, 3, 5, 1)
out = distributed.gather_rollouts(local, sizes=[2, 1], n=3, max_len=6)
m = distributed.reduce_metrics({"a": float(pid), "time/x": float(pid + 1)})
wrong = None
try:
    distributed.check_same_config({"seed": pid})
except distributed.ConfigMismatchError as e:
    wrong = str(e)
# A generation round: this process samples, scores and embeds its share (2 of the 4 prompts).
enc = t.CountingEncoder()
groups = t.score_round(distributed.ShareEngine(t.RowEngine()), enc)
print("RESULT", json.dumps({"tokens": out.tokens.tolist(), "mask": out.mask.tolist(),
    "logps": out.logprobs.tolist(),
    "reasons": out.finish_reasons, "m": m, "wrong": wrong,
    "round": t.groups_json(groups), "scored": t.SCORED, "embedded": enc.texts}), flush=True)
"""


@pytest.mark.slow
class TestTwoProcessCollectives:
    @pytest.fixture(scope="class")
    def results(self):
        port = multihost.free_port()
        env = dict(__import__("os").environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{REPO}:{REPO}/tests")
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _GATHER_SCRIPT, str(i), f"localhost:{port}"],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=REPO,
                env=env,
            )
            for i in range(2)
        ]
        outs = [p.communicate(timeout=_SUBPROCESS_S)[0] for p in procs]
        results = []
        for out in outs:
            line = [x for x in out.splitlines() if x.startswith("RESULT ")]
            assert line, out[-3000:]
            results.append(json.loads(line[0][len("RESULT ") :]))
        return results

    def test_gather_reduce_and_config_check(self, results):
        a, b = _rollout(2, 3, 3, 0), _rollout(1, 3, 5, 1)
        t = int(max(a.mask.sum(-1).max(), b.mask.sum(-1).max()))
        assert t > 3  # process 1's longer completions set the width
        for r in results:
            tokens = np.asarray(r["tokens"])
            assert tokens.shape == (3, 3, t)  # every prompt, padded to the longest completion
            np.testing.assert_array_equal(tokens[:2, :, :3], a.tokens)
            np.testing.assert_array_equal(tokens[:2, :, 3:], 0)
            np.testing.assert_array_equal(tokens[2], b.tokens[0, :, :t])
            np.testing.assert_array_equal(np.asarray(r["mask"])[2], b.mask[0, :, :t])
            logps = np.asarray(r["logps"], np.float32)
            np.testing.assert_array_equal(logps[2], b.logprobs[0, :, :t])
            assert r["reasons"] == a.finish_reasons + b.finish_reasons
            assert r["m"] == {"a": 0.5, "time/x": 2.0}  # mean, and max for times
            assert r["wrong"] and "processes [1]" in r["wrong"]

    def test_each_process_scores_its_own_share(self, results):
        """Each process ran the reward and the encoder on its own 2 prompts x 3 completions
        only, and both hold the round one process computes: tokens, log-probs, rewards,
        validity and embeddings bit for bit, texts included (the other share's decoded here)."""
        SCORED.clear()
        enc = CountingEncoder()
        one = groups_json(score_round(RowEngine(), enc))
        assert SCORED == [4 * 3] and enc.texts == 4 * 3  # one process scores all 12
        for r in results:
            assert r["scored"] == [2 * 3] and r["embedded"] == 2 * 3
            assert r["round"] == one
