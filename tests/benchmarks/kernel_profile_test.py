"""`benchmarks/kernel_profile.py`: kernel names to categories, device events out of a trace."""

import gzip
import json

import pytest

from mmr_jax.infra import bench_harness

kp = bench_harness.load("kernel_profile")


@pytest.mark.parametrize(
    "name, want",
    [
        # Names as they appear in H100/H200 traces of our train and decode steps.
        ("loop_transpose_fusion", "transpose"),
        ("loop_transpose_fusion_3", "transpose"),
        ("input_concatenate_fusion", "concatenate"),
        ("loop_concatenate_fusion_1", "concatenate"),
        ("loop_pad_fusion", "pad"),
        ("input_reduce_fusion_2", "reduce"),
        ("loop_reduce_fusion", "reduce"),
        ("loop_select_fusion", "select/convert/slice"),
        ("loop_convert_fusion_12", "select/convert/slice"),
        ("loop_dynamic_slice_fusion", "select/convert/slice"),
        ("dynamic_update_slice_fusion", "select/convert/slice"),
        ("cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_256x128_32x3_nn_align8", "matmul"),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNN", "matmul"),
        (
            "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1",
            "matmul",
        ),
        ("gemm_fusion_dot_general_3", "matmul"),
        ("loop_dot_fusion", "matmul"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
        ("flash_attention_forward", "attention"),
        ("loop_add_fusion", "other"),
        ("loop_multiply_fusion_4", "other"),
        ("copy_fusion", "other"),
        ("MemcpyD2D", "other"),
    ],
)
def test_category_of_real_kernel_names(name, want):
    assert kp.category(name) == want


def _trace():
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 3, "args": {"name": "python"}},
    ]
    x = [
        {"ph": "X", "pid": 1, "tid": 7, "name": "nvjet_tst_64x8", "dur": 300.0},
        {"ph": "X", "pid": 1, "tid": 7, "name": "loop_transpose_fusion", "dur": 100.0},
        {"ph": "X", "pid": 1, "tid": 7, "name": "loop_transpose_fusion", "dur": 50.0},
        {"ph": "X", "pid": 1, "tid": 7, "name": "input_concatenate_fusion", "dur": 50.0},
        {"ph": "X", "pid": 1, "tid": 8, "name": "fusion.3", "dur": 500.0},  # derived: dropped
        {"ph": "X", "pid": 2, "tid": 3, "name": "PjitFunction(step)", "dur": 999.0},  # host
        {"ph": "i", "pid": 1, "tid": 7, "name": "marker"},
    ]
    return {"traceEvents": meta + x}


def test_device_kernels_only_and_shares_per_step(tmp_path):
    kernels, source = kp.kernel_events(_trace())
    assert source == "device"
    assert sorted(kernels) == sorted(
        [
            ("nvjet_tst_64x8", 300.0),
            ("loop_transpose_fusion", 100.0),
            ("loop_transpose_fusion", 50.0),
            ("input_concatenate_fusion", 50.0),
        ]
    )
    folder = tmp_path / "plugins" / "profile" / "run1"
    folder.mkdir(parents=True)
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump(_trace(), f)
    t = kp.profile_table(tmp_path, steps=2)  # 500 us of kernels over 2 steps
    assert t["total_ms"] == pytest.approx(0.25)
    assert t["categories"]["matmul"]["share"] == pytest.approx(0.6)
    assert t["categories"]["transpose"]["ms"] == pytest.approx(0.075)
    assert t["layout_share"] == pytest.approx(0.4)
    assert t["top"][0] == {"name": "nvjet_tst_64x8", "ms": 0.15, "calls": 1, "category": "matmul"}
    assert t["top"][1]["calls"] == 2
    assert "transpose + concatenate + pad: 40.0%" in kp.format_table(t)


def test_a_real_cpu_trace_of_jax_has_the_program_s_thunks(tmp_path):
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda a, b: jnp.concatenate([a @ b, (a.T @ b).T], axis=0).sum(0))
    a = jnp.ones((128, 128))
    f(a, a).block_until_ready()
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        f(a, a).block_until_ready()
    t = kp.profile_table(tmp_path)
    assert t["source"] == "cpu" and t["kernels"] > 0
    assert t["categories"]["matmul"]["ms"] > 0  # the two dots


def test_no_trace_is_a_named_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="perfetto_trace"):
        kp.find_trace(tmp_path)
