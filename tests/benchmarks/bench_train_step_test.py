"""The train-step benchmark's paths compute the same step (tiny model, the bench's own code)."""

import json

import numpy as np

from mmr_jax.infra import bench_harness

from support import testing

bench = bench_harness.load("bench_train_step")


def test_all_paths_same_first_step_and_report(tmp_path):
    path = testing.make_tiny_checkpoint(tmp_path / "ckpt", tokenizer=False, vocab_size=300)
    out = bench.run_shape(str(path), bench.SHAPES["tiny"], rounds=1, same_state=True)
    full = out["first_step"]["full rows"]
    assert abs(full["loss"]) > 1e-5 and full["grad_norm"] > 1e-3
    for name in ("shared prompt", "packed"):
        for k in ("loss", "grad_norm", "entropy", "tokens", "ratio/mean"):
            got = out["first_step"][name][k]
            np.testing.assert_allclose(got, full[k], rtol=1e-5, atol=1e-6, err_msg=name + k)
    # Full rows pad to the maxima (16 + 16); shared prompts trim to the batch's buckets.
    assert out["shapes"]["full rows"]["tokens"] == [8, 32]
    n, t = out["shapes"]["shared prompt"]["tokens"]
    assert n == 8 and t < 16 and out["shapes"]["shared prompt"]["prompt_len"] <= 16
    # Packed: each group's inputs (completion length - 1 each) in one row of a bucket length.
    lengths = np.asarray(out["completion_lengths"]).reshape(2, 4)
    per_group = (lengths - 1).sum(-1).max()
    assert out["shapes"]["packed"]["tokens"] == [8, 16]  # T: the configured maximum
    assert per_group <= out["shapes"]["packed"]["packed_len"] < 1.5 * max(per_group, 8)
    assert out["completion_tokens"] == full["tokens"] == lengths.sum()
    for name in bench.PATHS:
        assert out[name]["ms_per_step"] > 0 and len(out[name]["ms_rounds"]) == 1
    table = bench._table({"tiny": out})
    assert "packed" in table and f"{out['packed']['speedup']:.2f}" in table
    json.dumps(out)  # the --json output is plain data
