"""Checkpoint locations: a local HF folder, or a hub repo id fetched once into the HF cache."""

from __future__ import annotations

import os
import pathlib

# What a policy checkpoint needs; weights in other formats (.bin, .pth, GGUF) are not fetched.
_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


def resolve_checkpoint(path_or_repo_id: str | os.PathLike) -> pathlib.Path:
    """The local folder of a checkpoint: `path_or_repo_id` itself, or its hub snapshot.

    A string of the form 'org/name' that is not a local folder is downloaded with
    `huggingface_hub.snapshot_download` (safetensors, config and tokenizer files only); with
    HF_HUB_OFFLINE=1 only the local cache is used.
    """
    path = pathlib.Path(path_or_repo_id).expanduser()
    if path.is_dir():
        return path
    text = os.fspath(path_or_repo_id)
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise FileNotFoundError(f"checkpoint folder {text!r} does not exist")
    import huggingface_hub

    try:
        local = huggingface_hub.snapshot_download(text, allow_patterns=_ALLOW_PATTERNS)
    except Exception as e:  # offline, unknown repo, gated model: one message naming both readings
        raise FileNotFoundError(
            f"{text!r} is neither a local checkpoint folder nor a Hugging Face repo this machine "
            f"can fetch ({type(e).__name__}: {e})"
        ) from e
    return pathlib.Path(local)
