"""`benchmarks/peer_step.py`: the PyTorch peer computes the same step as ours (same loss, same
gradient norm, same entropy and KL on the same weights and batch), and its CLI reports both."""

import json
import subprocess
import sys

import numpy as np
import pytest

from mmr_jax.infra import bench_harness

from support import testing

peer_step = bench_harness.load("peer_step")
peer_ours = bench_harness.load("peer_ours")
peer_torch = bench_harness.load("peer_torch")
peer_batch = bench_harness.load("peer_batch")
peer_job = bench_harness.load("peer_job")


def test_batch_layouts_hold_the_same_tokens():
    shape = peer_batch.Shape(prompts=2, generations=3, prompt_len=4, completion_len=5)
    b = peer_batch.make_batch(shape, vocab_size=50, beta=0.1, seed=1)
    rows = b.rows_with_prompts()
    assert rows.shape == (6, 9)
    for n in range(6):  # row n: its group's prompt, then its own completion
        np.testing.assert_array_equal(rows[n, :4], b.prompts_BxP[n // 3])
        np.testing.assert_array_equal(rows[n, 4:], b.completions_NxT[n])
    assert shape.tokens_shared() == 2 * 4 + 6 * 5 and shape.tokens_per_row() == 6 * 9
    assert b.ref_logps_NxT.shape == (6, 5)
    assert peer_batch.make_batch(shape, vocab_size=50, beta=0.0).ref_logps_NxT is None
    with pytest.raises(ValueError, match=">= 1"):
        peer_batch.make_batch(peer_batch.Shape(0, 1, 1, 1), vocab_size=5, beta=0)
    with pytest.raises(ValueError, match="unknown aggregation"):
        peer_batch.loss_normaliser("mean", 4, 5, 5)


@pytest.mark.parametrize(
    "overrides",
    [
        [],  # grpo's own loss: seq_mean_token_mean, beta 0.04 (the KL term on)
        ["loss.aggregation='token_mean'", "loss.beta=0.0", "rollout.temperature=1.0"],
    ],
    ids=["grpo", "token_mean_no_kl"],
)
def test_torch_peer_computes_our_loss_and_gradient(tmp_path, overrides):
    """Same weights (one checkpoint), same batch, fp32 on both sides: the first step's loss,
    gradient norm (every parameter's gradient enters it), entropy and KL agree to float32
    rounding (sums reordered over 4 rows x 16 tokens x 2 layers; measured 1.5e-7 relative)."""
    import torch

    ckpt = testing.make_tiny_checkpoint(tmp_path / "ckpt", family="qwen2", tokenizer=False)
    cfg = peer_ours.load_config(peer_step.SMOKE_CONFIG, peer_step.SMOKE_SET + overrides)
    job = peer_job.torch_job(cfg, checkpoint=str(ckpt))
    shape = peer_ours.shape_of(cfg)
    batch = peer_batch.make_batch(shape, vocab_size=job["vocab_size"], beta=cfg.loss.beta)
    compiled, args, _ = peer_ours.make_step(cfg, batch, str(ckpt))
    ours = peer_ours.metrics_of(compiled(*args))
    assert ours["grad_norm"] > 0 and (ours["kl"] > 0) == (cfg.loss.beta > 0)
    for checkpointing in (False, True):
        step, _ = peer_torch.make_step(job, torch.device("cpu"), checkpointing)
        theirs = step()
        for k, v in ours.items():
            assert theirs[k] == pytest.approx(v, rel=1e-5, abs=1e-7), (k, checkpointing)


def test_torch_job_refuses_what_the_peer_does_not_compute():
    base = peer_step.SMOKE_SET
    for extra, match in [
        (["lora.enabled=True"], "LoRA"),
        (["loss.kl_estimator='k1'"], "k3"),
        (["loss.iterations=2"], "one iteration"),
    ]:
        cfg = peer_ours.load_config(peer_step.SMOKE_CONFIG, base + extra)
        with pytest.raises(ValueError, match=match):
            peer_job.torch_job(cfg, checkpoint=None)


def test_summary_ratios_and_metric_differences():
    results = {
        "ours": {"step_s": 2.0, "tokens": 10, "metrics": {"loss": 1.0, "grad_norm": 4.0}},
        "torch": {"step_s": 5.0, "tokens": 20, "metrics": {"loss": 1.5, "grad_norm": 4.0}},
        "torch_ckpt": {"error": "timed out after 9 s"},
    }
    s = peer_step.summarize(results)
    assert s["ratio_to_ours"] == {"ours": 1.0, "torch": 2.5}
    assert s["metric_diff"]["torch"]["loss"] == {"abs": 0.5, "rel": 0.5}
    rows = peer_step.table_rows(results, s)
    text = bench_harness.format_table(rows, peer_step.COLUMNS)
    assert "2.50" in text and "FAILED: timed out after 9 s" in text


def test_random_weights_side_on_the_packed_default(tmp_path):
    # Without a checkpoint our side compiles the config's own program (random weights, as on a
    # GPU); configs pack completions by default, which the peer's shared-prompt batch is not.
    ckpt = peer_job.write_checkpoint(
        str(bench_harness.REPO / "third_party/hf_configs/deepseek_r1_distill_qwen_1_5b.json"),
        tmp_path / "ckpt",
        0,
        **peer_step.TINY_ARCH,
    )
    cfg = peer_ours.load_config(
        peer_step.SMOKE_CONFIG, [*peer_step.SMOKE_SET, f"model.path='{ckpt}'"]
    )
    assert cfg.batch.layout == "packed"
    shape = peer_ours.shape_of(cfg)
    vocab, beta = peer_ours.vocab_size(cfg), cfg.loss.beta
    batch = peer_batch.make_batch(shape, vocab_size=vocab, beta=beta, seed=0)
    compiled, args, _ = peer_ours.make_step(cfg, batch, None)
    assert args[1].packed is None and args[1].prompt_tokens.shape == batch.prompts_BxP.shape
    assert np.isfinite(peer_ours.metrics_of(compiled(*args))["loss"])


@pytest.mark.slow
def test_cpu_smoke_command_writes_both_sides(tmp_path):
    out = tmp_path / "peer.json"
    argv = [sys.executable, str(bench_harness.BENCHMARKS / "peer_step.py"), "--cpu_smoke"]
    argv += ["--sides=ours,torch", "--steps=1", "--warmup=0", f"--json={out}"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    ours, torch_ = r["sides"]["ours"], r["sides"]["torch"]
    assert ours["tokens"] == 2 * 16 + 4 * 16 and torch_["tokens"] == 4 * 32
    assert ours["metrics"]["loss"] == pytest.approx(torch_["metrics"]["loss"], rel=1e-5)
    assert r["summary"]["ratio_to_ours"]["torch"] == torch_["step_s"] / ours["step_s"]
    assert "side/ours" in proc.stdout


def test_side_timeouts_parse_per_side_and_refuse_unknown_sides():
    assert peer_step.side_timeouts("torch=40,ours=105", 0) == {
        "ours": 105.0,
        "torch_ckpt": 0,
        "torch": 40.0,
    }
    assert peer_step.side_timeouts("", 7) == dict.fromkeys(peer_step.SIDES, 7)
    with pytest.raises(SystemExit, match="side=seconds"):
        peer_step.side_timeouts("gpu=3", 0)
