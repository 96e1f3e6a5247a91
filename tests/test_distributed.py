"""Multi-process checks on CPU: data-parallel training and the All-to-All used by expert parallelism.

The slow tests read the results of tests/dist/check_collectives.py, which ran on 2 local CPU
workers in GRAPH_MODE in the session's one msrun job of the 2-worker checks (launched through
scripts/msrun_launcher.sh, so the launcher is tested too; see tests/workers.py); the expected
values are computed here with numpy. msrun must be on PATH and the `python` beside it must
have mindspore.
"""
import json
import os

import numpy as np
import pytest

import workers
from workers import WORLD, needs_msrun

worker = workers.load_script("check_collectives")


@pytest.fixture(scope="module")
def results(dist_checks):
    """The workers' results (GRAPH_MODE) as a loader `load(name, rank) -> np.ndarray`."""
    out_dir = dist_checks / "check_collectives"
    assert json.loads((out_dir / "done_rank0.json").read_text())["mode"] == "graph"
    return lambda name, rank: np.load(out_dir / f"{name}_rank{rank}.npy")


def _block(a, j):
    """Row block j of an AllToAll buffer [WORLD * C, ...]."""
    chunk = a.shape[0] // WORLD
    return a[j * chunk : (j + 1) * chunk]


# --- data parallel ----------------------------------------------------------------------------


def _reference_dp_params():
    """The tiny MLP trained in one process on the whole global batch, gradients by hand."""
    w1, b1, w2, b2 = (p.astype(np.float64) for p in worker.dp_initial_params())
    for step in range(worker.DP_STEPS):
        x, y = (a.astype(np.float64) for a in worker.dp_global_batch(step, WORLD))
        h = np.tanh(x @ w1.T + b1)
        out = h @ w2.T + b2
        d_out = 2.0 * (out - y) / out.size  # MSELoss: mean over every element
        d_pre = (d_out @ w2) * (1.0 - h**2)
        grads = (d_pre.T @ x, d_pre.sum(0), d_out.T @ h, d_out.sum(0))
        w1, b1, w2, b2 = (p - worker.DP_LR * g for p, g in zip((w1, b1, w2, b2), grads))
    return w1, b1, w2, b2


@pytest.mark.slow
@needs_msrun
def test_data_parallel_ranks_end_with_identical_parameters(results):
    for i in range(4):
        np.testing.assert_array_equal(results(f"dp_param{i}", 0), results(f"dp_param{i}", 1))


@pytest.mark.slow
@needs_msrun
def test_data_parallel_equals_one_process_on_the_concatenated_batch(results):
    for i, expected in enumerate(_reference_dp_params()):
        np.testing.assert_allclose(results(f"dp_param{i}", 0), expected, rtol=1e-5, atol=1e-6)


# --- AllToAll ---------------------------------------------------------------------------------


@pytest.mark.slow
@needs_msrun
@pytest.mark.parametrize("name", ["a2a_y", "a2a_group_y"], ids=["world_group", "named_group"])
def test_alltoall_block_i_on_rank_r_is_block_r_sent_by_rank_i(results, name):
    sent = [worker.alltoall_inputs(r, WORLD)[0] for r in range(WORLD)]
    for r in range(WORLD):
        expected = np.concatenate([_block(sent[i], r) for i in range(WORLD)])
        np.testing.assert_array_equal(results(name, r), expected)


@pytest.mark.slow
@needs_msrun
def test_alltoall_gradient_of_weighted_sum_is_the_transposed_weights(results):
    # loss = sum_r sum(w_r * y_r) with y_r[i] = x_i[r], so dloss/dx_i[r] = w_r[i].
    weights = [worker.alltoall_inputs(r, WORLD)[1] for r in range(WORLD)]
    for i in range(WORLD):
        expected = np.concatenate([_block(weights[r], i) for r in range(WORLD)])
        np.testing.assert_array_equal(results("a2a_grad", i), expected)


@pytest.mark.slow
@needs_msrun
def test_alltoall_twice_gives_back_the_input(results):
    for r in range(WORLD):
        np.testing.assert_array_equal(results("a2a_roundtrip", r), worker.alltoall_inputs(r, WORLD)[0])


def _v_blocks(a, counts):
    """Split rows of ``a`` into consecutive blocks of ``counts`` rows."""
    return np.split(a, np.cumsum(counts)[:-1])


@pytest.mark.slow
@needs_msrun
def test_alltoallv_uneven_blocks_arrive_in_source_order_and_gradients_go_back(results):
    counts = np.array(worker.alltoallv_counts(WORLD))
    sent = [_v_blocks(worker.alltoallv_inputs(r, WORLD)[0], counts[r]) for r in range(WORLD)]
    weights = [_v_blocks(worker.alltoallv_inputs(r, WORLD)[1], counts[:, r]) for r in range(WORLD)]
    for r in range(WORLD):
        # rank r receives block r of every source i, in source order: [sum_i counts[i, r], D]
        np.testing.assert_array_equal(results("a2av_y", r),
                                      np.concatenate([sent[i][r] for i in range(WORLD)]))
        # loss = sum_d sum(w_d * y_d): the rows rank r sent to d get d's weights for them
        np.testing.assert_array_equal(results("a2av_grad", r),
                                      np.concatenate([weights[d][r] for d in range(WORLD)]))


# --- single process ---------------------------------------------------------------------------


@pytest.mark.mindspore
def test_alltoall_with_one_rank_is_the_identity_forward_and_backward():
    ms = pytest.importorskip("mindspore")
    from ms_efficient.moe.alltoall import AllToAll

    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    w = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(4, 3)
    exchange = AllToAll()
    assert exchange.world == 1
    np.testing.assert_array_equal(exchange(ms.Tensor(x)).asnumpy(), x)
    weight = ms.Tensor(w)

    def loss(t):
        return (weight * exchange(t)).sum()

    grad = ms.grad(loss)(ms.Tensor(x))
    np.testing.assert_array_equal(grad.asnumpy(), w)


@pytest.mark.mindspore
def test_alltoall_rejects_an_unknown_implementation():
    pytest.importorskip("mindspore")
    from ms_efficient.moe.alltoall import AllToAll

    with pytest.raises(ValueError, match="'impl' must be one of"):
        AllToAll(impl="ring")


@pytest.mark.mindspore
def test_alltoallv_with_one_rank_is_the_identity_and_rejects_bad_counts():
    ms = pytest.importorskip("mindspore")
    from ms_efficient.moe.alltoall import AllToAllV

    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    w = np.linspace(-1.0, 1.0, 15, dtype=np.float32).reshape(5, 3)
    exchange = AllToAllV([5], [5], row_numel=3)
    np.testing.assert_array_equal(exchange(ms.Tensor(x)).asnumpy(), x)
    weight = ms.Tensor(w)

    def loss(t):
        return (weight * exchange(t)).sum()

    np.testing.assert_array_equal(ms.grad(loss)(ms.Tensor(x)).asnumpy(), w)
    with pytest.raises(ValueError, match="one per rank"):
        AllToAllV([2, 3], [5], row_numel=3)
    with pytest.raises(ValueError, match="'block_rows' must be >= every count"):
        AllToAllV([5], [5], row_numel=3, block_rows=4)


@pytest.mark.mindspore
def test_use_device_twice_after_a_kernel_ran_is_allowed():
    ms = pytest.importorskip("mindspore")
    from ms_efficient.core import backend

    (ms.Tensor(np.ones(3, np.float32)) * 2).asnumpy()       # the runtime is initialised
    backend.use_device("CPU")
    backend.use_device("CPU")
    assert backend.device_target() == "CPU"


def test_runtime_conf_turns_the_graph_pipeline_off_on_cpu_only_and_keeps_the_users_items():
    """The CPU ranks' MS_DEV_RUNTIME_CONF (core.backend.runtime_conf): the user's items first,
    then graph_pipeline:False; a user's own graph_pipeline stands; other targets unchanged."""
    from ms_efficient.core import backend

    assert backend.runtime_conf("CPU", "") == "graph_pipeline:False"
    assert (backend.runtime_conf("CPU", "compile_statistics:True") ==
            "compile_statistics:True,graph_pipeline:False")
    assert backend.runtime_conf("CPU", "memory_statistics:True,") == \
        "memory_statistics:True,graph_pipeline:False"
    assert backend.runtime_conf("CPU", "graph_pipeline:True") == "graph_pipeline:True"
    assert backend.runtime_conf("Ascend", "") == ""
    assert backend.runtime_conf("Ascend", "pipeline:False") == "pipeline:False"


def test_set_runtime_conf_sets_it_in_this_process_and_keeps_the_users_choice(monkeypatch):
    """What the one-process ``train`` sets before its first op (core.backend.set_runtime_conf)."""
    from ms_efficient.core import backend

    env = backend.RUNTIME_CONF_ENV
    monkeypatch.delenv(env, raising=False)
    assert backend.set_runtime_conf("CPU") == "graph_pipeline:False" == os.environ[env]
    monkeypatch.setenv(env, "graph_pipeline:True,compile_statistics:True")
    assert backend.set_runtime_conf("CPU") == "graph_pipeline:True,compile_statistics:True"
    assert os.environ[env] == "graph_pipeline:True,compile_statistics:True"
    monkeypatch.delenv(env)
    assert backend.set_runtime_conf("Ascend") == "" and env not in os.environ
