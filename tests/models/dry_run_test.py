"""Abstract builds of the paper's models: parameter counts match the formula and known totals."""

from __future__ import annotations

import json
import pathlib
import textwrap

import pytest

from mmr_jax.models import config as config_lib
from mmr_jax.models import dry_run
from mmr_jax.models import lora as lora_lib

from support import testing

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "third_party" / "hf_configs"
# Published totals (safetensors metadata of the HF repos): 1.78B, 7.62B, 8.03B, 135M.
KNOWN = {
    "deepseek_r1_distill_qwen_1_5b": 1_777_088_000,
    "deepseek_r1_distill_qwen_7b": 7_615_616_512,
    "deepseek_r1_distill_llama_8b": 8_030_261_248,
    "smollm2_135m_instruct": 134_515_008,
}


def _cfg(name):
    return config_lib.ModelConfig.from_hf(CONFIGS / f"{name}.json")


@pytest.mark.parametrize("name", list(KNOWN))
def test_formula_matches_known_total(name):
    assert dry_run.formula_param_count(_cfg(name)) == KNOWN[name]


def test_llama8b_config_fields():
    cfg = _cfg("deepseek_r1_distill_llama_8b")
    assert cfg.rope_scaling_dict["factor"] == 8.0 and cfg.rope_theta == 500000.0
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (32, 8, 128)


@pytest.mark.parametrize("name", ["deepseek_r1_distill_qwen_7b", "smollm2_135m_instruct"])
def test_abstract_counts_and_memory(name):
    cfg = _cfg(name)
    lora = lora_lib.LoraConfig()
    full = dry_run.summarize(cfg, mesh=dry_run.MeshShape(1, 8, 1))
    with_lora = dry_run.summarize(cfg, mesh=dry_run.MeshShape(1, 8, 1), lora=lora)
    assert full["params"] == full["formula_params"] == KNOWN[name]
    assert with_lora["params"] == KNOWN[name]
    assert (
        with_lora["trainable"] == with_lora["lora_params"] == dry_run.formula_lora_count(cfg, lora)
    )
    # fp32 full fine-tuning: params + grads + Adam mu, nu = 16 bytes per parameter, split ~8 ways.
    assert full["total_gib_per_device"] == pytest.approx(16 * KNOWN[name] / 8 / 2**30, rel=0.02)
    assert with_lora["grad_gib_per_device"] < full["grad_gib_per_device"]


class TestPod:
    def test_hosts_of_a_pod(self):
        assert dry_run.pod_hosts(2, 3) == [0, 0, 0, 1, 1, 1]
        with pytest.raises(ValueError, match="0 hosts"):
            dry_run.pod_hosts(0, 8)

    def test_pod_mesh_shape(self):
        # Hybrid: hosts along data, fsdp within a host; flat: fsdp over the whole pod.
        assert dry_run.pod_mesh_shape((1, -1, 1), hosts=4, devices_per_host=8) == (
            dry_run.MeshShape(4, 8, 1)
        )
        flat = dry_run.pod_mesh_shape((1, -1, 1), hosts=4, devices_per_host=8, over_hosts="flat")
        assert flat == dry_run.MeshShape(1, 32, 1)

    def test_script_summary_on_a_pod(self, capsys):
        script = testing.load_script("model_dry_run")
        config = str(CONFIGS / "smollm2_135m_instruct.json")
        argv = ["--config", config, "--json", "--mesh", "1,-1,1", "--devices_per_host", "8"]
        script.main([*argv, "--hosts", "4"])
        s = json.loads(capsys.readouterr().out)
        assert s["mesh"] == {"data": 4, "fsdp": 8, "tensor": 1}
        # fsdp over one host's 8 devices: 16 bytes a parameter (fp32 weights, grads, Adam) / ~8.
        assert s["total_gib_per_device"] == pytest.approx(16 * s["params"] / 8 / 2**30, rel=0.02)


# The compiled dry run on a fake pod of 2 hosts x 4 devices (8 virtual CPU devices, device i on
# host i // 4), in a fresh process: the hybrid default and flat over the hosts, same config.
_POD_SCRIPT = textwrap.dedent(
    """
    import json, math, sys
    import numpy as np
    from support import testing

    script = testing.load_script("model_dry_run")
    base = ["--train_config", "configs/grpo.py:smoke", "--hosts", "2", "--devices_per_host", "4",
            "--set", f"model.path={sys.argv[1]}", "--set", "batch.prompts=8",
            "--set", "batch.generations=2", "--set", "batch.max_prompt_len=16",
            "--set", "batch.max_completion_len=8", "--set", "loss.minibatches=1"]
    import jax
    from mmr_jax.training import compiled_dry_run, dry_run_programs
    from mmr_jax.config import schema
    from mmr_jax.config import command_line
    from mmr_jax.config import checks
    from mmr_jax.config import command_line

    def shard_bytes(tree):
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree))

    out = {}
    for over_hosts in ("hybrid", "flat"):
        args = script._parser().parse_args(base + ["--set", f"mesh.over_hosts={over_hosts}"])
        r = script.compiled(args)
        c = command_line.load_config_file(args.train_config)
        command_line.set_keys(c, command_line.parse_assignments(args.set))
        cfg = checks.from_config_dict(c)
        mesh = compiled_dry_run.config_mesh(cfg, hosts=[i // 4 for i in range(8)])
        _, targs = dry_run_programs.train_step_program(cfg, mesh)
        out[over_hosts] = dict(mesh=r["mesh"], hosts=r["hosts"], row_hosts=r["row_hosts"],
                               args=r["programs"][0].argument_bytes, want=shard_bytes(targs),
                               table=script.compiled_dry_run_table(r))
    print("RESULT", json.dumps(out))
    """
)


@pytest.mark.slow  # both meshes' train and decode steps compiled: ~20 s of CPU
def test_compiled_dry_run_on_two_hosts_of_four(tmp_path):
    """The hybrid default on 2 fake hosts x 4 devices compiles as (2, 4, 1), each data row one
    host's devices, and each device holds the bytes its shardings give (fsdp over 4: more than
    flat's fsdp over all 8)."""
    ckpt = testing.make_tiny_checkpoint(tmp_path / "ckpt", tokenizer=False, vocab_size=384)
    proc = testing.run_in_fresh_jax(_POD_SCRIPT, str(ckpt))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    hybrid, flat = out["hybrid"], out["flat"]
    assert hybrid["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1} and hybrid["hosts"] == 2
    assert hybrid["row_hosts"] == [[0] * 4, [1] * 4]
    assert flat["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    assert flat["row_hosts"] == [[0] * 4 + [1] * 4]
    for r in (hybrid, flat):
        assert r["args"] == r["want"], r
    assert hybrid["args"] > 1.5 * flat["args"]  # parameters and Adam split 4 ways, not 8
    assert "compiled on 8 devices (2 host(s))" in hybrid["table"]
    assert "data row 1: hosts [1]" in hybrid["table"]
