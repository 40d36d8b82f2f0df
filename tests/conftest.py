"""Shared pytest setup: slow/gpu markers and session-wide tiny checkpoints."""

import os
import pathlib
import sys

# Nothing in the tests may reach the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One math-verify grading worker per process the tests start (the default is min(2, CPUs)): each
# worker is an interpreter importing math-verify, and the tests start about a hundred processes
# that grade a few rows each. A two-worker pool is tested itself (tests/rewards/rewards_test.py).
os.environ.setdefault("MMR_JAX_GRADER_WORKERS", "1")
# Compiles dominate these tests (tiny models, many shapes), so XLA is asked to compile cheaply:
# the CPU backend's older loop emitters instead of its MLIR fusion emitters, at LLVM level 1 (as
# the scripts compile). Against level 0 with the fusion emitters (used here before), on 2 cores
# (2026-11-26): tests/models/shared_prompt_test.py + sampler_test.py took 196 s before, and 147 s
# now with advantages_test.py added. Not level 0 with the loop emitters (the two files in 89 s):
# that pair computes NaN for a gradient that is 0 under every other setting tried (advantages_test's
# degenerate groups). The scripts keep XLA's emitters: their train step runs 12% slower without
# them (`benchmarks/bench_compile.py --compare_options=...`, README). The tests' tolerances hold
# either way.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false"
)

# tests/ is a package, its folders mirroring the code (docs/testing.md), so pytest puts the repo
# root on sys.path, not tests/: appended here for `from support import ...`. Appended: no test
# folder (models/, distributed/, ...) may hide an installed package of that name.
sys.path.append(str(pathlib.Path(__file__).resolve().parent))

import jax
import pytest
from hypothesis import HealthCheck, settings

# Implicit rank promotion is an error in every test. Eleven modules set it at import, and a run
# imports every module it collects before its first test: a whole run had it on everywhere, a
# single file only if it set it, so a test could pass alone and fail in the whole run.
jax.config.update("jax_numpy_rank_promotion", "raise")

# The tests' own compiles (in this process) load and store XLA's persistent cache, the folder the
# whole-training modules already share with their scripts (`testing.XLA_CACHE_DIR`): many tests
# build the same program under a new `jax.jit`, and the two xdist workers build many of the same,
# so a cold run reuses them. On tests/step/train_step_test.py + tests/models/shared_prompt_test.py
# from an empty folder: 127 s of CPU against 154 s without (2026-11-29; all 38 pass either way).
# MMR_JAX_TEST_XLA_CACHE=off switches it off.
if os.environ.get("MMR_JAX_TEST_XLA_CACHE", "").lower() not in ("off", "0", "none"):
    from support import testing as _testing

    jax.config.update("jax_compilation_cache_dir", _testing.XLA_CACHE_DIR)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # The scripts the tests start (scripts/train.py, evaluate.py, the benchmarks: through
    # `infra/compile_cache.enable`) load and store the same folder, never ~/.cache: most of them
    # run the same tiny models, so a program one start-up compiled the next one loads. The key
    # is XLA's (program, compile options, versions, device), so a loaded executable is the one a
    # compile would have built and no result changes (the bit-for-bit resume tests pass with it).
    os.environ.setdefault("MMR_JAX_COMPILE_CACHE", _testing.XLA_CACHE_DIR)
# Off (MMR_JAX_TEST_XLA_CACHE=off): the scripts keep no compilation cache either.
os.environ.setdefault("MMR_JAX_COMPILE_CACHE", "off")

# Property-based tests (tests/algorithms/*_fuzz_test.py). 'ci', the default, is reproducible:
# derandomised (the same cases every run) with no example database. 'deep' draws 10x more cases,
# fresh each run: HYPOTHESIS_PROFILE=deep pytest tests -k fuzz. deadline=None: the first case of a
# shape compiles.
settings.register_profile(
    "ci",
    max_examples=100,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("deep", settings.get_profile("ci"), max_examples=1000, derandomize=False)
# 'quick' (10 per weight) for iterating on a property; the budget test fails under it by design.
settings.register_profile("quick", settings.get_profile("ci"), max_examples=10)
HYPOTHESIS_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(HYPOTHESIS_PROFILE)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")
    # Other test orders, to find tests that pass or fail depending on what ran before them
    # (docs/testing.md). Whole modules move; the tests of a module keep their order.
    parser.addoption(
        "--reverse-order", action="store_true", default=False, help="run the modules in reverse"
    )
    parser.addoption(
        "--module-order-seed", type=int, default=None, help="run the modules shuffled by this seed"
    )


def _module_order(config, items):
    """`items` with their modules reversed (--reverse-order) or shuffled (--module-order-seed)."""
    import random

    seed, reverse = config.getoption("--module-order-seed"), config.getoption("--reverse-order")
    if seed is None and not reverse:
        return items
    modules = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = list(modules)
    if seed is not None:
        random.Random(seed).shuffle(order)
    if reverse:
        order.reverse()
    return [item for name in order for item in modules[name]]


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    has_cuda = None
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords:
            if has_cuda is None:
                has_cuda = _has_cuda()
            if not has_cuda:
                item.add_marker(skip_gpu)
    items[:] = _module_order(config, items)


# Global state a test leaves changed (support/global_state.py) is restored and reported as an
# error of the module's last test: what a module changes it must put back, so that no test's
# outcome depends on the modules run before it on the same worker. Checked where a module's
# fixtures are all torn down, against the state before the first test.
_BASELINE = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if not _BASELINE:
        from support import global_state

        _BASELINE.update(global_state.snapshot())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    if _BASELINE and (nextitem is None or nextitem.path != item.path):
        from support import global_state

        changed = global_state.restore(_BASELINE)
        if changed:
            what = "; ".join(changed)
            pytest.fail(f"{item.path.name} left global state changed (restored): {what}", False)
    return result


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A random-weight Llama checkpoint with a trained tokenizer, shared by the session."""
    from support import testing

    return testing.make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), family="llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """A random-weight Qwen2 checkpoint (q/k/v bias) with a trained tokenizer."""
    from support import testing

    return testing.make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), family="qwen2")


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    """The tiny Llama checkpoint loaded as a `Decoder` (one per test module)."""
    from mmr_jax import models

    return models.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def qwen2(tiny_qwen2_dir):
    """The tiny Qwen2 checkpoint loaded as a `Decoder` (one per test module)."""
    from mmr_jax import models

    return models.from_pretrained(tiny_qwen2_dir)


def pytest_terminal_summary(terminalreporter):
    """One line with the number of generated cases the property-based tests checked."""
    counts = [
        value
        for report in terminalreporter.stats.get("passed", [])
        for key, value in getattr(report, "user_properties", [])
        if key == "fuzz_examples"
    ]
    if counts:
        terminalreporter.write_line(
            f"fuzz: {sum(counts)} generated cases in {len(counts)} property tests "
            f"(hypothesis profile {HYPOTHESIS_PROFILE!r})"
        )
