"""Writes docs/package_tree.md from the tree: each subpackage's docstring, each module's first line.

    python scripts/package_tree_doc.py            # rewrite docs/package_tree.md
    python scripts/package_tree_doc.py --check    # exit 1 when the page differs from the tree

tests/package_tree_test.py runs the check, so a module added, moved or re-described without
regenerating the page fails the tests.
"""

import ast
import difflib
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "package_tree.md"
# The library's parts: the method's math and one step first, then what they stand on.
ORDER = (
    "algorithms", "step", "training", "models", "kernels", "rollout", "serving", "rewards",
    "problems", "distributed", "studies", "config", "infra",
)  # fmt: skip
HEADER = """# Layout: what each module holds

Generated from the tree by `python scripts/package_tree_doc.py` (each subpackage's docstring, each
module's first docstring line); `tests/package_tree_test.py` fails when this page and the tree
differ. What may import what is stated in each `__init__.py` and checked by the same test.

    setup.cfg            package metadata and dependencies (pyproject.toml: build backend, ruff)
    constraints/ci.txt   the tested pins CI installs
    mmr_jax/             the library, one subpackage per role (below)
    configs/             base.py holds every key; one file per variant (`:1.5b|7b|8b[,smoke]`)
    scripts/             entry points: train, evaluate, serve, study, prepare_*, plot_run,
                         launch_vllm, model_dry_run, filter_prompts, package_tree_doc,
                         step_fingerprint; setup_*.sh, gpu_check.sh
    benchmarks/          one short file per benchmark over infra/bench_harness.py; the PyTorch peer
    tests/               pytest + chex, laid out as the code: tests/<sub>/<module>_test.py tests
                         mmr_jax/<sub>/<module>.py (other names there: one behaviour across the
                         subpackage's modules; config/ also the config files); tests/scripts
                         and tests/benchmarks mirror those folders; tests/end_to_end holds whole
                         runs; support/ the test tooling
    third_party/         upstream HF configs, the vLLM server's pins (sources and licences inside)
    docs/                one page per subject (docs/README.md)
"""


def _doc(path: pathlib.Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def _first_line(doc: str) -> str:
    first = doc.split("\n\n")[0].replace("\n", " ").strip()
    return first.replace("|", "\\|")


def render() -> str:
    lib = REPO / "mmr_jax"
    lines = [HEADER]
    lines += ["## mmr_jax/", "", _first_line(_doc(lib / "__init__.py")), ""]
    parts = sorted(p.name for p in lib.iterdir() if (p / "__init__.py").exists())
    missing = set(parts) - set(ORDER)
    if missing:
        raise SystemExit(f"add {sorted(missing)} to ORDER in scripts/package_tree_doc.py")
    for name in ORDER:
        pkg = lib / name
        lines += [f"### mmr_jax/{name}/", "", _doc(pkg / "__init__.py").strip(), ""]
        lines += ["| module | what it holds |", "|---|---|"]
        for mod in sorted(pkg.glob("*.py")):
            if mod.name != "__init__.py":
                lines.append(f"| `{mod.name}` | {_first_line(_doc(mod))} |")
        others = sorted(p.name for p in pkg.iterdir() if p.suffix not in (".py", ".pyc"))
        others = [o for o in others if o != "__pycache__"]
        if others:
            lines.append(f"| {', '.join(f'`{o}`' for o in others)} | (not Python) |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv) -> int:
    text = render()
    if "--check" in argv:
        old = OUT.read_text() if OUT.exists() else ""
        if old != text:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True)))
            print("docs/package_tree.md is out of date: run python scripts/package_tree_doc.py")
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
