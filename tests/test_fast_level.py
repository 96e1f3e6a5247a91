"""The fast level's twins agree: FastLevelOps (MindSpore ops, compiled in GRAPH mode) and the
aot kernel (kernels/cpu/fast_level.cc) give the tables of fast_level_tables (numpy
balance_step) entry for entry, on random counts with hot, cold and empty experts, replicated
and empty home slots, tight buffers (moves and drops), per-step copies with copy costs, and
node rounds."""
import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor

from ms_efficient.moe.balance import balance_step, ops_twin_launches_L
from ms_efficient.moe.fast_level import (FastLevel, FastLevelOps, fast_level_tables,
                                         profiled_launches)

ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")

NAMES = ("sent_WEW", "slot_EW", "spare_WS", "source_WS", "home_slot_WE", "stats")


def random_home(rng, world, experts, slots):
    """Every expert once, then most free slots a random (possibly repeated) expert, the
    rest empty (-1)."""
    table = np.full(world * slots, -1)
    order = rng.permutation(world * slots)
    table[order[:experts]] = np.arange(experts)
    for j in order[experts:]:
        if rng.random() < 0.7:
            table[j] = rng.integers(experts)
    return table.reshape(world, slots)


def random_counts(rng, kind, world, experts):
    """kind 0: uniform; 1: Dirichlet-skewed (hot and cold); 2: one hot expert and one empty."""
    if kind == 0:
        return rng.integers(0, 20, (world, experts))
    if kind == 1:
        p = rng.dirichlet(np.full(experts, 0.2))
        return np.stack([rng.multinomial(40, p) for _ in range(world)])
    counts = rng.integers(0, 3, (world, experts))
    counts[:, rng.integers(experts)] += 30
    counts[:, rng.integers(experts)] = 0
    return counts


# (world, experts, home slots, spare slots, devices per node, buffer range, copy cost?)
CASES = [(4, 8, 3, 1, None, (20, 120), True),
         (4, 8, 3, 2, 2, (60, 90), True),
         (8, 16, 3, 1, 4, (40, 60), True),
         (8, 8, 2, 1, 2, (30, 70), False),
         (2, 4, 2, 0, None, (30, 50), True)]


@pytest.mark.parametrize("world,experts,slots,spare,dpn,buf,costly", CASES)
def test_the_compiled_twins_give_the_numpy_fast_level_tables(world, experts, slots, spare, dpn,
                                                             buf, costly):
    rng = np.random.default_rng(world * 100 + experts + spare)
    cost = rng.uniform(0, 30, (world, world)) if costly else None
    if cost is not None:
        np.fill_diagonal(cost, 0.0)
    buffer_W = rng.integers(*buf, world)
    twins = (FastLevelOps(world, experts, spare, buffer_W, cost, dpn, trips=True),
             FastLevel(world, experts, spare, buffer_W, cost, dpn, impl="aot"))
    seen = np.zeros(4, dtype=int)           # copies, drops, replicated experts, empty experts
    for i in range(24):
        home = random_home(rng, world, experts, slots)
        counts = random_counts(rng, i % 3, world, experts)
        want = fast_level_tables(counts, home, spare, buffer_W, cost, dpn)
        # the ops twin's loops run the iterations balance_step reports (what it is charged by)
        want_trips = balance_step(counts[None], home[None], np.full(world, spare),
                                  buffer_W[None], cost, devices_per_node=dpn).trips_L4[0]
        for twin in twins:
            got = twin(Tensor(counts.astype(np.int32)), Tensor(home.astype(np.int32)))
            for name, a, b in zip(NAMES + ("trips",), want + (want_trips,), got):
                assert b.asnumpy().tolist() == a.tolist(), (type(twin).__name__, name,
                                                            home.tolist(), counts.tolist())
        seen += [want[5][0] > 0, want[5][1] > 0,
                 (np.bincount(home[home >= 0], minlength=experts) > 1).any(),
                 (counts.sum(axis=0) == 0).any()]
    # the cases reach every branch: copies (when there are spare slots), drops, replicas
    assert seen[1] > 0 and seen[3] > 0
    assert (seen[0] > 0) == (spare > 0)
    assert (seen[2] > 0) == (world * slots > experts)


def test_the_ops_twin_launches_the_kernels_its_loop_iterations_are_charged(tmp_path):
    """MindSpore's profiler counts the kernels the compiled ops twin launches over six
    layer-steps with water-fills, copies and buffer moves; balance.OPS_TWIN_LAUNCHES over the
    loop iterations the twin reports (Balance.trips_L4) gives that count within 2 % (the
    loops' conditions short-circuit on data: a few launches either way)."""
    world, experts, slots, spare, dpn = 8, 16, 3, 1, 4
    rng = np.random.default_rng(5)
    cost = rng.uniform(0, 30, (world, world))
    np.fill_diagonal(cost, 0.0)
    twin = FastLevelOps(world, experts, spare, rng.integers(40, 60, world), cost, dpn,
                        trips=True)
    inputs = [(Tensor(random_counts(rng, i % 3, world, experts).astype(np.int32)),
               Tensor(random_home(rng, world, experts, slots).astype(np.int32)))
              for i in range(6)]
    twin(*inputs[0])                                                   # compile
    trips = np.stack([twin(*args)[6].asnumpy() for args in inputs])         # [N, 4]
    assert (trips.sum(axis=0) > 0).all(), trips                          # every loop ran
    launches = sum(profiled_launches(twin, inputs, str(tmp_path)).values())
    charged = int(ops_twin_launches_L(trips, len(inputs)).sum())
    assert abs(launches - charged) <= 0.02 * launches, (launches, charged, trips.tolist())


def test_a_hand_sized_step_copies_the_hot_expert_and_drops_nothing():
    """2 devices, experts {0, 2} on device 0 and {1, 3} on 1, one spare slot each; expert 0
    takes 60 of the 80 rows: device 0 would compute 65, device 1 15. Copying expert 0 to
    device 1 and water-filling its 60 rows over both (other loads 5 and 15, level
    (60 + 20) / 2 = 40) gives 35 and 25 rows of it, 40 and 40 in all."""
    counts = np.array([[30, 5, 5, 0], [30, 5, 0, 5]])
    home = np.array([[0, 2], [1, 3]])
    got = FastLevelOps(2, 4, 1, np.array([64, 64]), None, None)(
        Tensor(counts.astype(np.int32)), Tensor(home.astype(np.int32)))
    sent, slot, spare_WS, source_WS, home_slot, stats = (t.asnumpy() for t in got)
    assert stats.tolist() == [1, 0, 80, 40, 40]
    assert spare_WS.tolist() == [[-1], [0]] and source_WS.tolist() == [[-1], [0]]
    assert slot[0].tolist() == [0, 2]                      # home slot 0, spare slot S_h + 0
    assert sent[:, 0].sum(axis=0).tolist() == [35, 25]    # expert 0 on each device
    # ranks keep what their own device computes; rank 1's other 5 rows go to device 0
    assert sent[0, 0].tolist() == [30, 0] and sent[1, 0].tolist() == [5, 25]


def test_fast_level_picks_its_twin_by_target_and_refuses_bad_names(monkeypatch):
    from ms_efficient.core import backend

    args = (2, 4, 1, np.array([8, 8]), None, None)
    assert FastLevel(*args).impl == "aot"                  # CPU: the compiled kernel
    assert FastLevel(*args, impl="host").impl == "host"
    assert FastLevel(*args, impl="ops").impl == "ops"
    with pytest.raises(ValueError, match="'fast_level' must be one of .'auto', 'host', "
                                         "'aot', 'ops'., but got 'device'"):
        FastLevel(*args, impl="device")
    with pytest.raises(ValueError, match=r"'buffer_W' must be \[2\] rows"):
        FastLevelOps(2, 4, 1, np.array([8]), None, None)
    monkeypatch.setattr(backend, "device_target", lambda: "Ascend")
    assert FastLevel(*args).impl == "ops"
    for impl in ("host", "aot"):
        with pytest.raises(ValueError, match=f"'{impl}' runs on the host, on CPU only, but the "
                                             f"target is Ascend"):
            FastLevel(*args, impl=impl)


def test_auto_falls_back_to_the_host_op_when_the_kernel_cannot_be_built(monkeypatch, caplog):
    import ms_efficient.moe.fast_level as fast_level
    from ms_efficient.moe.kernels import KernelBuildError

    def no_compiler(*_):
        raise KernelBuildError("C++ compiler 'g++' not found on PATH")

    monkeypatch.setattr(fast_level, "_aot_tables", no_compiler)
    args = (2, 4, 1, np.array([8, 8]), None, None)
    with caplog.at_level("WARNING"):
        assert FastLevel(*args).impl == "host"
    assert "the aot kernel cannot be built (C++ compiler 'g++' not found" in caplog.text
    with pytest.raises(KernelBuildError, match="not found"):
        FastLevel(*args, impl="aot")                       # asked for by name: no fallback
