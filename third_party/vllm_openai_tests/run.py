"""vLLM's own OpenAI-server tests against our server and vLLM's, same model, one command.

    python third_party/vllm_openai_tests/run.py --sdist=vllm-0.32.0.tar.gz \
        --vllm_python=.venv-vllm/bin/python --pytest_path=<dir with pytest + pytest-asyncio>

Extracts FILES from vLLM's source release (the sdist on PyPI) into work/ (not committed), puts
`shim_utils.py` in place of vLLM's tests/utils.py (the fixture's server: the only change), runs
the files once per server (SUITE_SERVER=ours, then vllm) under vLLM's Python (the tests import
vllm), and prints per server passed / failed / errors / skipped, then every test that passes on
vLLM but not on ours. Results: work/<server>.xml (JUnit).
"""

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
OPENAI = "tests/entrypoints/openai/"
FILES = [
    "completion/test_completion.py",
    "completion/test_prompt_validation.py",
    "chat_completion/test_chat.py",
    "chat_completion/test_chat_echo.py",
    "chat_completion/test_chat_completion.py",
    "chat_completion/test_batched_chat_completions.py",
    "chat_completion/test_chat_logit_bias_validation.py",
    "chat_completion/test_logprob_token_ids.py",
    "chat_completion/test_enable_force_include_usage.py",
    "test_return_token_ids.py",
    "test_return_tokens_as_ids.py",
]

# Imported by FILES, not run: vLLM's packages' __init__ files, a module test_batched_... uses
# and the helpers that one imports.
SUPPORT = [
    "__init__.py",
    "completion/__init__.py",
    "chat_completion/__init__.py",
    "chat_completion/test_serving_chat.py",
    "utils.py",  # tests/entrypoints/openai/utils.py, which test_serving_chat.py imports
]


def extract(sdist: pathlib.Path, work: pathlib.Path) -> None:
    shutil.rmtree(work / "tests", ignore_errors=True)
    with tarfile.open(sdist) as tar:
        root = tar.getnames()[0].split("/")[0]
        for name in FILES + SUPPORT:
            member = tar.extractfile(f"{root}/{OPENAI}{name}")
            dest = work / OPENAI / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(member.read())
        (work / "LICENSE").write_bytes(tar.extractfile(f"{root}/LICENSE").read())
    for pkg in ("tests", "tests/entrypoints"):
        (work / pkg / "__init__.py").touch()
    shutil.copy(HERE / "shim_utils.py", work / "tests" / "utils.py")
    (work / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")


def offline_hub(work: pathlib.Path, model: pathlib.Path) -> pathlib.Path:
    """An HF cache in which every hub name the FILES ask for (their MODEL_NAME, read by
    `get_tokenizer(MODEL_NAME)`) is the served model's files: this machine has no hub, and the
    tests' tokenizer must be the served model's anyway."""
    home = work / "hf_home"
    names = set()
    for name in FILES:
        text = (work / OPENAI / name).read_text()
        names |= set(re.findall(r'^MODEL_NAME = "([^"]+)"', text, re.M))
    for repo in sorted(names):
        cache = home / "hub" / f"models--{repo.replace('/', '--')}"
        snap = cache / "snapshots" / "local"
        snap.mkdir(parents=True, exist_ok=True)
        (cache / "refs").mkdir(exist_ok=True)
        (cache / "refs" / "main").write_text("local")
        for f in model.iterdir():
            if not (snap / f.name).exists():
                (snap / f.name).symlink_to(f.resolve())
    return home


def outcomes(xml: pathlib.Path) -> dict[str, str]:
    out = {}
    for case in ET.parse(xml).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        out[name] = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sdist", required=True, help="vllm-<version>.tar.gz from PyPI")
    ap.add_argument("--vllm_python", required=True, help="python of a vllm(-cpu) venv")
    ap.add_argument("--pytest_path", default="", help="extra sys.path with pytest, pytest-asyncio")
    ap.add_argument("--model", default=str(REPO / "checkpoints" / "smollm2-135m-instruct"))
    ap.add_argument("--servers", default="ours,vllm")
    ap.add_argument("--k", default=None, help="pytest -k")
    ap.add_argument("--files", default="", help="comma-separated part of FILES (default: all)")
    ap.add_argument("--work", default=str(HERE / "work"), help="where the tests are extracted")
    args = ap.parse_args()
    work = pathlib.Path(args.work).resolve()  # HF_HOME below must not depend on the cwd
    extract(pathlib.Path(args.sdist), work)
    hf_home = offline_hub(work, pathlib.Path(args.model))
    files = args.files.split(",") if args.files else FILES
    unknown = sorted(set(files) - set(FILES))
    if unknown:
        ap.error(f"--files: not in FILES: {unknown}")
    results = {}
    for server in args.servers.split(","):
        env = {
            **os.environ,
            "SUITE_SERVER": server,
            "HF_HOME": str(hf_home),
            "HF_HUB_OFFLINE": "1",
            "SUITE_MODEL": args.model,
            "SUITE_VLLM": args.vllm_python,
            "SUITE_OURS_PYTHON": sys.executable,
            "SUITE_OURS_SCRIPT": str(REPO / "scripts" / "serve.py"),
            "PYTHONPATH": os.pathsep.join(p for p in (args.pytest_path, str(work)) if p),
        }
        xml = work / f"{server}.xml"
        cmd = [args.vllm_python, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rN",
               "--continue-on-collection-errors",
               f"--junitxml={xml}", *[OPENAI + f for f in files]]  # fmt: skip
        if args.k:
            cmd += ["-k", args.k]
        subprocess.run(cmd, cwd=work, env=env, check=False)
        results[server] = outcomes(xml)
    for server, res in results.items():
        counts = {
            k: sum(v == k for v in res.values()) for k in ("passed", "failure", "error", "skipped")
        }
        print(f"{server}: {len(res)} tests: {counts}")
    if {"ours", "vllm"} <= results.keys():
        ours, theirs = results["ours"], results["vllm"]
        worse = sorted(t for t, v in theirs.items() if v == "passed" and ours.get(t) != "passed")
        print(f"passed on vLLM, not on ours ({len(worse)}):")
        for t in worse:
            print(f"  {t}: {ours.get(t)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
