"""Checkpoint locations: a local HF folder, or a hub repo id fetched once into the HF cache;
`load_tokenizer`, the one tokenizer loader of the scripts (a wrong path named as such)."""

from __future__ import annotations

import json
import os
import pathlib

from mmr_jax.infra import user_errors

# What a policy checkpoint needs; weights in other formats (.bin, .pth, GGUF) are not fetched.
_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
EXPECTED = "a Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer) or a hub id"
# Checkpoints the repository builds itself (relative to its root), and the command that builds each.
BUILT_HERE = {"checkpoints/smollm2-135m-instruct": "python scripts/prepare_smollm2.py"}


class CheckpointNotFoundError(user_errors.UserError, FileNotFoundError):
    """A checkpoint path that is neither a local folder nor a hub repo this machine can fetch."""


class CheckpointNotBuiltError(CheckpointNotFoundError):
    """A checkpoint the repository builds itself (`BUILT_HERE`) that was not built here."""


def _is_repo_id(text: str) -> bool:
    return text.count("/") == 1 and not text.startswith((".", "/", "~"))


def resolve_checkpoint(
    path_or_repo_id: str | os.PathLike, what: str = "checkpoint"
) -> pathlib.Path:
    """The local folder of a checkpoint: `path_or_repo_id` itself, or its hub snapshot.

    A string of the form 'org/name' that is not a local folder is downloaded with
    `huggingface_hub.snapshot_download` (safetensors, config and tokenizer files only); with
    HF_HUB_OFFLINE=1 only the local cache is used. Anything else raises
    `CheckpointNotFoundError` naming `what`; one the repository builds (`BUILT_HERE`, the CPU
    default's SmolLM2) and that is not there, `CheckpointNotBuiltError` naming the command.
    """
    path = pathlib.Path(path_or_repo_id).expanduser()
    if path.is_dir():
        return path
    text = os.fspath(path_or_repo_id)
    built_by = BUILT_HERE.get(pathlib.PurePath(text).as_posix())
    if built_by and not path.exists():
        raise CheckpointNotBuiltError(
            f"{what} {text!r} does not exist; build it with `{built_by}` in the repository's "
            f"root (the path is relative to the folder you run from: {os.getcwd()})"
        )
    if path.exists() or not _is_repo_id(text):
        reason = "is a file, not a folder" if path.exists() else "does not exist"
        raise CheckpointNotFoundError(f"{what} {text!r} {reason}; give {EXPECTED} ('org/name')")
    import huggingface_hub

    try:
        local = huggingface_hub.snapshot_download(text, allow_patterns=_ALLOW_PATTERNS)
    except Exception as e:  # offline, unknown repo, gated model: one message naming both readings
        cause = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise CheckpointNotFoundError(
            f"{what} {text!r} is neither a local checkpoint folder nor a Hugging Face repo this "
            f"machine can fetch ({type(e).__name__}: {cause})"
        ) from e
    return pathlib.Path(local)


# Where `load_tokenizer` may skip AutoTokenizer. For a Llama folder whose tokenizer_config.json
# names one of these classes (and no remote code), transformers 5's AutoTokenizer resolves to
# `TokenizersBackend`, but only after AutoConfig, whose import brings in torch: 2.3 s of every
# script's start-up on the tiny checkpoints the tests build and on the CPU default, for the same
# object. Not for qwen2: AutoTokenizer overrides the declared class with `Qwen2Tokenizer` there,
# which splits text differently. tests/models/hub_test.py checks both readings.
_PLAIN_BACKEND_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
_PLAIN_BACKEND_MODEL_TYPES = frozenset({"llama"})


def _json(path: pathlib.Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def declares_plain_backend(folder: pathlib.Path) -> bool:
    """Whether AutoTokenizer would load `folder`'s tokenizer as a plain `TokenizersBackend`
    (the cases listed above, decided from the folder's JSON files without importing transformers'
    config classes)."""
    tokenizer_config = _json(folder / "tokenizer_config.json")
    return (
        (folder / "tokenizer.json").is_file()
        and tokenizer_config.get("tokenizer_class") in _PLAIN_BACKEND_CLASSES
        and "auto_map" not in tokenizer_config
        and _json(folder / "config.json").get("model_type") in _PLAIN_BACKEND_MODEL_TYPES
    )


def load_tokenizer(path_or_repo_id: str | os.PathLike, what: str = "checkpoint"):
    """The checkpoint's tokenizer, as transformers' AutoTokenizer chooses it: a path that is not a
    checkpoint is a `CheckpointNotFoundError`, not transformers' guess about a missing tokenizer
    library. A folder that `declares_plain_backend` is loaded as that class directly."""
    import transformers

    folder = resolve_checkpoint(path_or_repo_id, what)
    if declares_plain_backend(folder):
        return transformers.TokenizersBackend.from_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)
