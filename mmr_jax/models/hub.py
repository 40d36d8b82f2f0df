"""Checkpoint locations: a local HF folder, or a hub repo id fetched once into the HF cache;
`load_tokenizer`, the one tokenizer loader of the scripts (a wrong path named as such)."""

from __future__ import annotations

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


def load_tokenizer(path_or_repo_id: str | os.PathLike, what: str = "checkpoint"):
    """The checkpoint's tokenizer (transformers' AutoTokenizer): a path that is not a checkpoint
    is a `CheckpointNotFoundError`, not transformers' guess about a missing tokenizer library."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(resolve_checkpoint(path_or_repo_id, what))
