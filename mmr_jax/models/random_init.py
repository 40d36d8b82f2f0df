"""Random weights of a real architecture and a tokenizer that needs no download (model.init).

With these, `scripts/train.py` runs the whole loop of any config (rollout, rewards, the update,
the weight hand-over) without a checkpoint: for timing and memory on a machine lent for minutes.
The weights follow the decoder's own initialisation (normal(0.02) matrices and embeddings, unit
norms, zero biases; `layers`), drawn on the devices with the parameters' shardings. The tokenizer
is byte-level BPE over the 256 byte symbols, with synthetic merges (byte pairs, then triples) up
to the model's vocabulary size, so every id the model can sample decodes, and the ChatML special
tokens the chat template uses. Nothing here is meant to learn: the text a random model writes is
noise.
"""

from __future__ import annotations

import itertools

import jax
from flax import nnx

from mmr_jax.models import config as config_lib
from mmr_jax.models import decoder, sharding
from mmr_jax.models import lora as lora_lib

# ChatML (Qwen2, SmolLM2). Ids: 0 <|endoftext|>, 1 <|im_start|>, 2 <|im_end|> (EOS), 3 <pad>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>")
EOS, PAD = "<|im_end|>", "<pad>"


def _synthetic_vocab(size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Special tokens, the 256 byte symbols, then merges of byte pairs and triples up to `size`."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate((*SPECIAL_TOKENS, *alphabet))}
    merges: list[tuple[str, str]] = []
    pairs = ((a, b) for a, b in itertools.product(alphabet, repeat=2))
    triples = ((a + b, c) for a, b, c in itertools.product(alphabet, repeat=3))
    for a, b in itertools.chain(pairs, triples):
        if len(vocab) >= size:
            break
        merges.append((a, b))
        vocab[a + b] = len(vocab)
    return vocab, merges


def byte_tokenizer(vocab_size: int):
    """A `PreTrainedTokenizerFast` of exactly `vocab_size` ids (byte-level BPE, ChatML template,
    EOS `<|im_end|>`, pad `<pad>`), built in memory in about a second for a 152k vocabulary."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers

    minimum = len(SPECIAL_TOKENS) + 256
    if vocab_size < minimum:
        raise ValueError(f"byte_tokenizer needs vocab_size >= {minimum}, got {vocab_size}")
    vocab, merges = _synthetic_vocab(vocab_size)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=None, unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def byte_tokenizer_of(path) -> object:
    """`byte_tokenizer` of the vocabulary size of `path`'s architecture (`config.config_file`)."""
    return byte_tokenizer(config_lib.ModelConfig.from_hf(config_lib.config_file(path)).vocab_size)


def random_model(
    cfg: config_lib.ModelConfig,
    *,
    dtype,
    param_dtype,
    mesh: jax.sharding.Mesh | None = None,
    lora: lora_lib.LoraConfig | None = None,
    seed: int = 0,
    frozen_dtype=None,
) -> decoder.Decoder:
    """A `Decoder` of `cfg`'s shapes with random weights, in eval mode.

    Drawn under one jit whose outputs are the parameters with their partition rules on `mesh`
    (`sharding.named_sharding`), so a 7B model is never whole on one device or the host.
    """

    def make():
        return decoder.Decoder(
            cfg,
            dtype=dtype,
            param_dtype=param_dtype,
            lora=lora,
            frozen_dtype=frozen_dtype,
            rngs=nnx.Rngs(seed),
        )

    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    shardings = None
    if mesh is not None:
        shardings = nnx.from_flat_state(
            [
                (path, var.replace(sharding.named_sharding(path, var.get_value().shape, mesh)))
                for path, var in nnx.to_flat_state(abstract)
            ]
        )
    state = jax.jit(lambda: nnx.split(make())[1], out_shardings=shardings)()
    model = nnx.merge(graphdef, state)
    model.eval()
    return model
