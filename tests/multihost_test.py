"""Multi-process training (mmr_jax.distributed) on real CPU process clusters: start-up checks,
the per-process share and gathers, and the contract: N processes x k devices give the metrics of
one process with N * k devices and the same mesh shape."""

import json
import math
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from mmr_jax import build, distributed, faults, metrics
from mmr_jax.rollout import base as rollout_base

from support import multihost

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "configs"))
import dapo  # noqa: E402
import grpo  # noqa: E402

# A process whose peer died exits within this (the heartbeat timeout is 30 s).
_PEER_EXIT_S = 120
# Host-side timings and throughput differ between runs; everything else must agree.
_UNTIMED = ("time/", "throughput/")
# mismatch/* are differences of two log-probs of the same tokens (sampler vs trainer), each of
# magnitude up to ~log(V) = 6.2 with an fp32 ulp of 4.8e-7: they are rounding noise themselves,
# and two layouts round differently. Four ulps of 8.0.
_ROUNDING_KEYS, _ROUNDING_ATOL = ("mismatch/",), 4 * float(np.spacing(np.float32(8.0)))


def _config(module, ckpt, *, steps=2, **overrides) -> dict:
    c = module.get_config("smoke")
    c.model.path = str(ckpt)
    c.total_steps = steps
    c.lora.enabled = False
    c.mmr.enabled = True
    c.data.source = build.ARITHMETIC
    c.data.system_prompt = ""
    c.batch.max_prompt_len = 32
    c.batch.max_completion_len = 16
    c.optim.lr = 1e-3
    c.optim.warmup_ratio = 0.0
    c.rewards.weights = {"test_target": 1.0, "format": 0.0}
    c.dynamic_sampling.filter_reward = "test_target"
    c.checkpoint.every = 1
    c.logging.samples = 0
    c.logging.tensorboard = False
    c.mesh.shape = (1, 2, 1)  # the same mesh shape in both layouts: fsdp over 2 devices
    for key, value in overrides.items():
        node = c
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        node[last] = value
    return json.loads(json.dumps(c.to_dict()))


def _run(cfg, workdir, *, processes, devices, timeout=900, **kw):
    results = multihost.wait(
        multihost.launch(cfg, workdir, processes=processes, devices=devices, **kw), timeout
    )
    return results


def _ok(results):
    for rc, out in results:
        assert rc == 0 and "WORKER DONE" in out, out[-4000:]


def _metrics(workdir) -> list[dict]:
    rows = metrics.read_jsonl(pathlib.Path(workdir) / metrics.METRICS_FILE)
    return [{k: v for k, v in r.items() if not k.startswith(_UNTIMED)} for r in rows]


def _assert_same(a: list[dict], b: list[dict]):
    assert [r["step"] for r in a] == [r["step"] for r in b] and a
    for ra, rb in zip(a, b, strict=True):
        assert set(ra) == set(rb), set(ra) ^ set(rb)
        for k in ra:
            atol = _ROUNDING_ATOL if k.startswith(_ROUNDING_KEYS) else 1e-6
            assert math.isclose(ra[k], rb[k], rel_tol=2e-5, abs_tol=atol), (
                ra["step"],
                k,
                ra[k],
                rb[k],
            )


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

    def _train(self, *flags, timeout=120):
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
            "import sys; from mmr_jax import console; "
            "console.setup(sys.argv[1], stdout=sys.argv[2] == '1'); console.info('hello %d', 7)"
        )
        for shown in ("1", "0"):
            log = tmp_path / f"run{shown}.log"
            r = subprocess.run(
                [sys.executable, "-c", script, str(log), shown],
                capture_output=True,
                text=True,
                cwd=REPO,
                timeout=120,
            )
            assert r.returncode == 0, r.stderr
            assert ("hello 7" in r.stdout) == (shown == "1")
            assert "hello 7" in log.read_text()  # the log file has it either way


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
sys.path.insert(0, "tests")
import multihost_test as t
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
print("RESULT", json.dumps({"tokens": out.tokens.tolist(), "mask": out.mask.tolist(),
    "logps": out.logprobs.tolist(),
    "reasons": out.finish_reasons, "m": m, "wrong": wrong}), flush=True)
"""


@pytest.mark.slow
class TestTwoProcessCollectives:
    def test_gather_reduce_and_config_check(self, tmp_path):
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
        outs = [p.communicate(timeout=120)[0] for p in procs]
        results = []
        for out in outs:
            line = [x for x in out.splitlines() if x.startswith("RESULT ")]
            assert line, out[-3000:]
            results.append(json.loads(line[0][len("RESULT ") :]))
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


@pytest.fixture(scope="module")
def grpo_reference(tmp_path_factory, tiny_llama_dir):
    """(config, workdir) of 3 GRPO+MMR steps on 1 process x 2 devices: the reference run."""
    cfg = _config(grpo, tiny_llama_dir, steps=3, **{"checkpoint.export_hf": True})
    one = tmp_path_factory.mktemp("multihost") / "one"
    _ok(_run(cfg, one, processes=1, devices=2))
    return cfg, one


def _tensors(folder) -> dict:
    from safetensors.numpy import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _check_contract(cfg, one, two):
    _ok(_run(cfg, two, processes=2, devices=1))
    a, b = _metrics(one), _metrics(two)
    assert len(a) == cfg["total_steps"] and a[0]["grad_norm"] > 0
    assert a[0]["advantage/abs_mean"] > 0 and a[0]["reward/std"] > 0  # a step with signal
    _assert_same(a, b)
    return a


@pytest.mark.slow
class TestContract:
    """2 processes x 1 device against 1 process x 2 devices (mesh (1, 2, 1) in both)."""

    def test_grpo_mmr(self, tmp_path, grpo_reference):
        cfg, one = grpo_reference
        two = tmp_path / "two"
        a = _check_contract(cfg, one, two)
        assert all(r["mmr/lambda_mean"] > 0 for r in a)
        # Process 0 alone wrote the HF exports, from weights gathered over both processes.
        ref, got = (_tensors(d / "step_3") for d in (one, two))
        assert ref.keys() == got.keys() and ref
        for k in ref:
            np.testing.assert_allclose(got[k], ref[k], rtol=2e-5, atol=1e-6, err_msg=k)

    def test_dapo_dynamic_sampling(self, tmp_path, tiny_llama_dir):
        # The filter reward is constant on about half the groups: they are dropped and refilled.
        cfg = _config(
            dapo,
            tiny_llama_dir,
            steps=3,
            **{
                "mmr.enabled": False,
                "rewards.weights": {"test_target": 1.0, "test_target_even": 0.0},
                "dynamic_sampling.filter_reward": "test_target_even",
                "dynamic_sampling.max_generation_batches": 4,
                # Evaluation at the last step over 5 held-out problems: shares of 3 and 2.
                "eval.every": 3,
                "eval.source": build.ARITHMETIC,
                "eval.arithmetic_problems": 5,
                "eval.n": 2,
                "eval.max_new_tokens": 8,
            },
        )
        assert cfg["dynamic_sampling"]["enabled"]
        one = tmp_path / "one"
        _ok(_run(cfg, one, processes=1, devices=2))
        a = _check_contract(cfg, one, tmp_path / "two")
        assert any(r["dynamic_sampling/dropped_frac"] > 0 for r in a)  # the retry loop ran
        assert any(r["dynamic_sampling/generation_batches"] > 1 for r in a)
        assert "eval/heldout/pass@1" in a[-1]  # compared with the rest


@pytest.mark.slow
class TestFaults:
    def test_killed_process_then_resume_on_one(self, tmp_path, grpo_reference):
        """Process 1 dies in step 3's update: process 0 exits with a named error in bounded time;
        the run then resumes on 1 process x 2 devices from step 2 with the reference metrics."""
        cfg, one = grpo_reference
        work = tmp_path / "killed"
        procs = multihost.launch(
            cfg, work, processes=2, devices=1, per_process_env=[{}, {faults.ENV: "train:3"}]
        )
        procs[1].wait(timeout=900)
        died = time.monotonic()
        procs[0].wait(timeout=_PEER_EXIT_S)  # a hang fails here
        waited = time.monotonic() - died
        out0 = pathlib.Path(procs[0].out_path).read_text()
        assert procs[1].returncode == -9
        assert procs[0].returncode != 0 and "PeerLostError" in out0, out0[-3000:]
        assert waited < _PEER_EXIT_S
        assert [r["step"] for r in _metrics(work)] == [1, 2]
        _ok(_run(cfg, work, processes=1, devices=2))  # 2 -> 1 processes, same checkpoint
        _assert_same(_metrics(one), _metrics(work))

    def test_resume_one_to_two(self, tmp_path, grpo_reference):
        """A 1-process run killed in step 3 resumes on 2 processes with the reference metrics."""
        cfg, one = grpo_reference
        work = tmp_path / "w"
        procs = multihost.launch(
            cfg, work, processes=1, devices=2, per_process_env=[{faults.ENV: "train:3"}]
        )
        assert procs[0].wait(timeout=900) == -9
        assert [r["step"] for r in _metrics(work)] == [1, 2]
        _ok(_run(cfg, work, processes=2, devices=1))  # 1 -> 2 processes, same checkpoint
        _assert_same(_metrics(one), _metrics(work))

    def test_killed_coordinator_bounded_exit(self, tmp_path, grpo_reference):
        """Process 0 (which runs the coordinator) dies in step 2's update: process 1 stops within
        the bound, by PeerLostError or by JAX's own fatal error (its coordination service is
        gone); never a hang."""
        cfg, _ = grpo_reference
        procs = multihost.launch(
            cfg,
            tmp_path / "w",
            processes=2,
            devices=1,
            per_process_env=[{faults.ENV: "train:2"}, {}],
        )
        procs[0].wait(timeout=900)
        died = time.monotonic()
        procs[1].wait(timeout=_PEER_EXIT_S)
        out1 = pathlib.Path(procs[1].out_path).read_text()
        assert procs[0].returncode == -9 and procs[1].returncode != 0
        assert time.monotonic() - died < _PEER_EXIT_S
        assert "PeerLostError" in out1 or "JAX distributed service detected fatal" in out1, out1
