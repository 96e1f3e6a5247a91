"""Shared fixtures: a tiny config and a tiny text corpus built inside tests/ (no ../shared), and
the 2-worker msrun checks' results (one job for the session, see tests/workers.py)."""
import gc
import os
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import graph_cache  # noqa: E402  (tests/graph_cache.py)
import workers  # noqa: E402  (tests/workers.py)


def _host_blocking_run_in_this_process() -> None:
    """Start this session's MindSpore with ``MS_DEV_HOST_BLOCKING_RUN=1`` (a developer
    variable of MindSpore 2.10, read when its runtime starts): ops and graphs run on the
    calling thread, with no ``frontend_queue`` / ``backend_queue`` threads, whose
    ``AsyncRQueue::Wait`` spun in this process and in its queue thread (6-8 % of a
    two-module session's CPU in ``perf record``, about 2 % of the whole suite's) and took
    the core from the other session and the child processes. The variable is set for the
    first op only: the child processes the tests start (msrun ranks, CLI runs) get the
    environment as it was, as users run them. The suite's equality checks (one-process
    against expert-parallel runs, replicated against unreplicated experts) run either way."""
    if "MS_DEV_HOST_BLOCKING_RUN" in os.environ:        # the caller's choice stands
        return
    import numpy as np
    import mindspore as ms

    os.environ["MS_DEV_HOST_BLOCKING_RUN"] = "1"
    try:
        (ms.Tensor(np.ones(1, np.float32)) + 1).asnumpy()
    finally:
        os.environ.pop("MS_DEV_HOST_BLOCKING_RUN", None)


_host_blocking_run_in_this_process()


# --- float32 rounding bounds ------------------------------------------------------------------
# For tests that compare two float32 computations of the same quantity by different kernels or
# summation orders (a grouped matmul against a batched one, one slot against two replicas, a
# 2-rank run against one process, numpy against MindSpore). Their results need not be equal
# bit for bit; how far apart they may be follows from float32 rounding: any evaluation of a
# sum of n products, in any order, blocked or with FMA, satisfies
#     |fl(sum_i a_i b_i) - sum_i a_i b_i| <= gamma_n * sum_i |a_i| |b_i|,
#     gamma_n = n u / (1 - n u),  u = 2**-24 (float32's unit roundoff)
# (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.5), so two of them
# differ by at most twice that. A test derives `n` and the per-element `scale` (the sum of
# the terms' magnitudes) from its shapes and inputs; a real bug (a wrong expert, a missing
# bias, a dropped token, a factor of 2) moves values by about their own size, orders of
# magnitude above these bounds.

U32 = 2.0 ** -24                  # float32 unit roundoff (round to nearest)


def gamma32(n):
    """gamma_n = n u / (1 - n u) for float32: the relative bound on a sum of n products."""
    n = np.asarray(n, np.float64)
    if np.any(n * U32 >= 1):
        raise ValueError(f"gamma_n needs n * u < 1, but got n = {n}")
    return n * U32 / (1 - n * U32)


def float32_bound(n, scale):
    """2 * gamma_n * scale: the most two float32 evaluations of the same sum of ``n``
    products (any two orders or kernels) can differ by, ``scale`` being the sum of the
    terms' magnitudes sum_i |a_i| |b_i| (a number or an array, per element)."""
    return 2 * gamma32(n) * np.asarray(scale, np.float64)


FLOAT32_MARGINS = []              # (label, max |a - b|, its bound, max |a - b| / bound) per check


def assert_within_float32_bound(actual, desired, bound, err_msg=""):
    """|actual - desired| <= bound element by element (in float64; ``bound`` broadcasts, as
    from :func:`float32_bound`). Records the check's margin in FLOAT32_MARGINS."""
    actual = np.asarray(actual, np.float64)
    desired = np.asarray(desired, np.float64)
    bound = np.broadcast_to(np.asarray(bound, np.float64), desired.shape)
    assert actual.shape == desired.shape, (actual.shape, desired.shape, err_msg)
    diff = np.abs(actual - desired)
    ratio = np.divide(diff, bound, out=np.where(diff > 0, np.inf, 0.0), where=bound > 0)
    worst = np.unravel_index(np.argmax(ratio), ratio.shape) if ratio.size else ()
    FLOAT32_MARGINS.append((err_msg, float(diff.max(initial=0.0)),
                            float(bound[worst]) if ratio.size else 0.0,
                            float(ratio.max(initial=0.0))))
    bad = ~(diff <= bound)                                 # NaN differences fail too
    if bad.any():
        raise AssertionError(
            f"{err_msg}: {int(bad.sum())} of {diff.size} elements differ by more than the "
            f"float32 rounding bound; worst at {worst}: |{actual[worst]!r} - {desired[worst]!r}| "
            f"= {diff[worst]:.3g} > {bound[worst]:.3g} (max difference {diff.max():.3g}, "
            f"max difference / bound {ratio.max():.3g})")


def _background_fixtures(item):
    return [n for n in getattr(item, "fixturenames", ()) if n in workers._BACKGROUND]


def pytest_collection_modifyitems(session, config, items):
    """Tests reading a fixture computed in the background (tests/workers.py: the 2-worker
    checks, the EP training run, the measured memopt check) run last, in their order, so the
    fixtures' child processes overlap every other test."""
    items[:] = ([i for i in items if not _background_fixtures(i)]
                + [i for i in items if _background_fixtures(i)])


def pytest_collection_finish(session):
    """Queue the background fixtures the selected tests read, in the order they are read
    (nothing for --collect-only)."""
    _DEFERRED["ids"] = {i.nodeid for i in session.items if _background_fixtures(i)}
    if not session.config.option.collectonly:
        workers.start_background([n for item in session.items
                                  for n in _background_fixtures(item)])


_FROZEN = {}                 # "module": the test module whose first test froze the heap


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the first test of each module (before its fixtures), collect and then freeze
    what the session holds (``gc.freeze``: the imported modules, the session's caches of
    compiled networks): MindSpore runs a full ``gc.collect()`` before every Cell compile,
    and a frozen object is not traversed again. After collection that is ~200 000 objects
    (88 ms a collect here); in a ``perf record`` of three in-process modules the collector's
    share of the CPU fell from 4.4 % to 0.7 %. An object frozen and dropped later is freed by
    its reference count, or, if in a cycle, only at the end of the session."""
    module = item.nodeid.split("::")[0]
    if module != _FROZEN.get("module"):
        _FROZEN["module"] = module
        gc.collect()
        gc.freeze()


@pytest.fixture(autouse=True)
def _runtime_conf_as_it_was():
    """A test calling the one-process ``train.trainer.train`` in this process (directly or
    through ``cli.main``) sets ``MS_DEV_RUNTIME_CONF`` here as it does in a process of its own
    (``core.backend.set_runtime_conf``; this session's runtime started long before, so it
    changes only what later child processes inherit): put it back after each test."""
    before = os.environ.get("MS_DEV_RUNTIME_CONF")
    yield
    if before is None:
        os.environ.pop("MS_DEV_RUNTIME_CONF", None)
    else:
        os.environ["MS_DEV_RUNTIME_CONF"] = before


def pytest_sessionfinish(session):
    workers.cleanup()
    _EXIT["status"] = int(session.exitstatus)


_EXIT = {}                   # "status": the session's exit status, once it finished


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """With MS_EFFICIENT_TESTS_FAST_EXIT=1 (``make test`` sets it), end the process here with
    the session's exit status, skipping the interpreter's teardown: freeing the session's
    compiled MindSpore graphs one Cell at a time (``Cell.__del__``) took 15-65 s after the
    last test on this machine, and nothing is left to write (the terminal summary, cache and
    reports are done; temporary folders were removed by ``workers.cleanup``)."""
    if os.environ.get("MS_EFFICIENT_TESTS_FAST_EXIT") == "1" and "status" in _EXIT:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT["status"])


_DEFERRED = {}               # "ids": the tests reading a background fixture; "start": when
                             # the first of them started (seconds from the session's start)


def pytest_runtest_logstart(nodeid, location):
    if nodeid in _DEFERRED.get("ids", ()) and "start" not in _DEFERRED:
        _DEFERRED["start"] = time.perf_counter() - workers._T0


def pytest_terminal_summary(terminalreporter):
    """How many graph extractions the modules using ``shared_graphs`` shared; when each
    background computation ran and when the main thread reached the tests that read them:
    which of the two threads sets the session's length."""
    if any(graph_cache.STATS.values()):
        terminalreporter.write_line(
            "graph extractions of the modules using shared_graphs: "
            + ", ".join(f"{n} {k}" for k, n in graph_cache.STATS.items())
            + "".join(f"; {n} unshared: {why}" for why, n in graph_cache.REASONS.items()))
    if workers._TIMES:
        terminalreporter.write_line(
            f"background fixtures: {workers.timeline()}; the tests reading them from "
            f"{_DEFERRED.get('start', float('nan')):.0f} s")


@pytest.fixture(scope="module")
def shared_graphs():
    """Identical graph extractions done once per session, for the modules that plan the same
    user networks again and again (tests/graph_cache.py)."""
    with pytest.MonkeyPatch.context() as patch:
        graph_cache.install(patch)
        yield


@pytest.fixture(scope="session")
def dist_checks():
    """The folder of the 2-worker checks' results: tests/dist/NAME.py's are in NAME/."""
    return workers.background_result("dist_checks")


@pytest.fixture(scope="session")
def one_rank_ep_runs():
    """({"one" or dispatch: run folder}, the child's stdout) of the one-process run and the
    W = 1 expert-parallel runs (tests/test_ep_train.py's ``_one_rank_ep_runs``, computed in
    the background)."""
    return workers.background_result("one_rank_ep_runs")


def write_corpus(folder) -> str:
    """Write 40 small generated text files (about 60 kB) into a new ``folder``; its path."""
    folder.mkdir()
    for i in range(40):
        lines = [f"def function_{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range(40)]
        (folder / f"mod_{i:02d}.py").write_text("".join(lines))
    return str(folder)


@pytest.fixture
def text_dir(tmp_path):
    """A folder of 40 small generated text files (about 60 kB), the test's own."""
    return write_corpus(tmp_path / "corpus")


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """The same corpus as ``text_dir``, one for the session (module fixtures; not to be
    changed)."""
    return write_corpus(tmp_path_factory.mktemp("shared") / "corpus")


def tiny_config_dict(data_path: str, out_dir: str) -> dict:
    """A 2-layer, 4-expert model small enough to train a few steps in seconds."""
    return {
        "context": {"seed": 7},
        "model": {"seq_length": 32, "hidden_size": 32, "num_layers": 2, "num_heads": 2,
                  "ffn_hidden_size": 64},
        "moe": {"num_experts": 4, "top_k": 2, "capacity_factor": 1.25, "trace_ranks": 2},
        "data": {"path": data_path, "max_bytes": 200000, "val_fraction": 0.1},
        "train": {"steps": 6, "batch_size": 4, "learning_rate": 3e-3, "warmup_steps": 2,
                  "log_every": 2, "eval_every": 3, "eval_batches": 2, "save_every": 3,
                  "out_dir": out_dir},
    }


@pytest.fixture(scope="module")
def graph_mode():
    """MindSpore's GRAPH_MODE on CPU for a module's tests, the previous mode restored after
    (for modules that also hold numpy-only tests, which should not import MindSpore)."""
    import mindspore as ms

    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    yield
    ms.set_context(mode=mode)
