"""The package tree as the architecture (issue 48): which subpackage may import which, no import
circles between modules, pure math with no I/O, docs/package_tree.md generated from the tree, and
every repository path the docs name present in it (every test named as `file::Test::test` too)."""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "mmr_jax"

# What each part of mmr_jax may import of mmr_jax, as each __init__.py states it. Bottom first:
# infra and kernels import nothing of the library; studies sit on top and nothing imports them.
ALLOWED = {
    "infra": set(),
    "kernels": set(),
    "algorithms": set(),
    "rewards": set(),
    "models": {"kernels", "infra"},
    "config": {"algorithms", "models", "infra"},
    "rollout": {"models", "kernels", "infra", "config"},
    "serving": {"rollout", "models", "infra", "config"},
    "distributed": {"rollout"},
    "problems": {"rewards", "rollout", "distributed", "infra"},
    "step": {"algorithms", "models", "rollout", "rewards", "distributed", "infra", "config"},
    "training": {
        "step",
        "algorithms",
        "models",
        "rollout",
        "rewards",
        "distributed",
        "infra",
        "config",
        "problems",
        "kernels",
    },  # fmt: skip
    "studies": {
        "training",
        "step",
        "models",
        "rollout",
        "distributed",
        "infra",
        "config",
        "problems",
    },  # fmt: skip
}
# Standard-library and third-party modules that do I/O, forbidden in the pure math.
IO_MODULES = {"os", "io", "pathlib", "time", "logging", "absl", "requests", "subprocess", "json"}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, modules=()) -> set[str]:
    """Every module `path` imports: `from pkg import name` counts as pkg.name where that is one
    of `modules`, else as pkg."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                out.add(full if full in modules else node.module)
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        name: {m for m in _imports(p, modules) if m in modules and m != name}
        for name, p in modules.items()
    }


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_each_part_imports_only_what_its_init_allows():
    bad = sorted(
        f"{m} imports {d}"
        for m, deps in _graph().items()
        for d in deps
        if _part(m) is not None
        and _part(d) is not None
        and _part(d) != _part(m)
        and _part(d) not in ALLOWED[_part(m)]
    )
    assert not bad, bad


def test_every_part_is_listed_and_no_module_sits_loose_at_the_top():
    parts = {_part(m) for m in _graph() if _part(m) is not None}
    assert parts == set(ALLOWED), parts ^ set(ALLOWED)
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert not loose, loose


def test_no_import_circles_between_modules():
    graph = _graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                pytest.fail("import circle: " + " -> ".join([*path, m, d]))
            if d not in state:
                visit(d, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_the_math_does_no_io():
    for p in (PACKAGE / "algorithms").glob("*.py"):
        roots = {m.split(".")[0] for m in _imports(p)}
        assert not roots & IO_MODULES, (p.name, roots & IO_MODULES)
        assert "open(" not in p.read_text(), p.name


def test_every_module_says_what_it_holds():
    missing = [
        _module_name(p)
        for p in PACKAGE.rglob("*.py")
        if not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert not missing, missing


def test_docs_layout_is_the_generated_one():
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "package_tree_doc.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_tests_mirror_the_code():
    """Each test module sits in the folder of what it tests (docs/testing.md)."""
    tests = REPO / "tests"
    code = {p.name for p in (REPO / "mmr_jax").iterdir() if (p / "__init__.py").exists()}
    folders = code | {"scripts", "benchmarks", "end_to_end", "support"}
    top = sorted(p.name for p in tests.glob("*_test.py"))
    assert top == ["global_state_test.py", "package_tree_test.py"], top
    for path in tests.rglob("*_test.py"):
        folder = path.relative_to(tests).parts[0]
        if path.parent != tests:
            assert folder in folders, f"{path.relative_to(REPO)}: tests/{folder}/ mirrors no code"
            assert (path.parent / "__init__.py").exists(), f"{path.parent}: not a package"


# Paths the docs name on purpose that are not in the tree: a mistake's example, a file said not to
# exist, a placeholder.
NOT_PATHS = {"configs/nope.py", "configs/rloo.py", "configs/x.py"}
SUBPACKAGES = "|".join(sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py")))
DOC_PATH = re.compile(
    r"(?<![\w/.<-])((?:mmr_jax|scripts|configs|tests|benchmarks)/[\w./-]*\w"
    rf"|(?:{SUBPACKAGES})/\w+\.py)"
)
NODE_IDS = re.compile(r"(?:::\w+)+")  # `tests/x_test.py::TestY::test_z`


def doc_paths_missing(repo: pathlib.Path) -> list[str]:
    """'page:line: path' for each repository path (`mmr_jax/...`, `scripts/...`, `configs/...`,
    `tests/...`, `benchmarks/...`, or a module as `training/build.py`) a docs page or the README
    names that is not in the tree, as a file or folder from the repository root, the page's
    folder, `mmr_jax/` or `tests/` (a placeholder with `<`, `*` or `{` is not a path); and each
    `path.py::Name::name` whose class or function is not defined in that file."""
    pages = sorted(repo.glob("docs/**/*.md")) + [repo / "README.md"]
    missing = []
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for match in DOC_PATH.finditer(line):
                path, after = match.group(1), line[match.end() : match.end() + 1]
                if after in "<*{" and after or path in NOT_PATHS:
                    continue
                places = (repo, page.parent, repo / "mmr_jax", repo / "tests")
                found = [place / path for place in places if (place / path).exists()]
                if not found:
                    missing.append(f"{page.relative_to(repo)}:{number}: {path}")
                elif ids := NODE_IDS.match(line, match.end()):
                    for name in _undefined(found[0], ids.group(0).strip(":").split("::")):
                        missing.append(f"{page.relative_to(repo)}:{number}: {path}::{name}")
    return missing


def _undefined(path: pathlib.Path, names: list[str]) -> list[str]:
    """The names of a pytest node id (`TestX`, `test_y`) that `path` defines no class or function
    of."""
    text = path.read_text() if path.is_file() else ""
    defined = set(re.findall(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)", text, re.M))
    return [name for name in names if name not in defined]


def test_docs_name_only_paths_that_exist():
    missing = doc_paths_missing(REPO)
    assert not missing, "\n".join(missing)


def test_the_docs_path_check_finds_a_missing_path(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "train.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "a_test.py").write_text("class TestA:\n    def test_b(self): ...\n")
    (tmp_path / "docs" / "a.md").write_text(
        "Run `scripts/train.py`, then scripts/trian.py; see tests/<sub>/x_test.py, "
        "configs/nope.py and step/pipline.py.\n"
        "`tests/a_test.py::TestA::test_b` holds; `tests/a_test.py::TestA::test_c` is gone.\n"
    )
    (tmp_path / "README.md").write_text("`python benchmarks/gone.py --json=x`\n")
    assert doc_paths_missing(tmp_path) == [
        "docs/a.md:1: scripts/trian.py",
        "docs/a.md:1: step/pipline.py",
        "docs/a.md:2: tests/a_test.py::test_c",
        "README.md:1: benchmarks/gone.py",
    ]
