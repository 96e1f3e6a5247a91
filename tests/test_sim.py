"""Tests for the shared event-driven simulator: hand-solved schedules, memory accounting,
error messages, and an equivalence test against a naive time-stepping scheduler."""

import numpy as np
import pytest

from ms_efficient.sim import Simulator, transfer_time_s

MB = 1_000_000
GBps = 1e9
ALPHA = 10e-6


# ---------------------------------------------------------------- schedules
def test_chain_on_one_resource_takes_the_sum_of_durations():
    sim = Simulator()
    sim.add_task("a", "dev0.compute", 1.0)
    sim.add_task("b", "dev0.compute", 2.0, deps=["a"])
    sim.add_task("c", "dev0.compute", 3.0, deps=["b"])
    res = sim.run()
    assert res.makespan_s == 6.0
    assert [res.start_s[k] for k in "abc"] == [0.0, 1.0, 3.0]
    assert [res.end_s[k] for k in "abc"] == [1.0, 3.0, 6.0]


def test_chain_across_two_resources_waits_for_each_dependency():
    sim = Simulator()
    a = sim.add_task("a", "dev0.compute", 1.0)
    b = sim.add_task("b", "dev1.compute", 2.0, deps=[a])  # deps by id
    sim.add_task("c", "dev0.compute", 3.0, deps=[b])
    res = sim.run()
    assert (res.start_s["b"], res.start_s["c"], res.makespan_s) == (1.0, 3.0, 6.0)


def test_fork_join_takes_the_longer_branch():
    sim = Simulator()
    sim.add_task("a", "dev0.compute", 1.0)
    sim.add_task("b", "dev1.compute", 2.0, deps=["a"])
    sim.add_task("c", "dev2.compute", 5.0, deps=["a"])
    sim.add_task("d", "dev0.compute", 1.0, deps=["b", "c"])
    res = sim.run()
    assert res.makespan_s == 1.0 + max(2.0, 5.0) + 1.0
    assert res.start_s["b"] == res.start_s["c"] == 1.0
    assert res.critical_path() == ["a", "c", "d"]


def test_independent_tasks_on_one_resource_serialize_in_insertion_order():
    sim = Simulator()
    sim.add_task("a", "r", 2.0)
    sim.add_task("b", "r", 3.0)
    res = sim.run()
    assert (res.start_s["b"], res.makespan_s) == (2.0, 5.0)
    assert res.critical_path() == ["a", "b"]


def test_two_transfers_on_one_link_serialize():
    sim = Simulator()
    sim.add_transfer("x", "link:dev0->dev1", MB, ALPHA, GBps)
    sim.add_transfer("y", "link:dev0->dev1", MB, ALPHA, GBps)
    res = sim.run()
    assert res.end_s["x"] == pytest.approx(1.01e-3, rel=1e-12)
    assert res.end_s["y"] == pytest.approx(2.02e-3, rel=1e-12)


def test_transfers_on_two_links_run_in_parallel():
    sim = Simulator()
    sim.add_transfer("x", "link:dev0->dev1", MB, ALPHA, GBps)
    sim.add_transfer("y", "link:dev0->dev2", MB, ALPHA, GBps)
    res = sim.run()
    assert res.end_s["x"] == res.end_s["y"] == pytest.approx(1.01e-3, rel=1e-12)
    assert transfer_time_s(MB, ALPHA, GBps) == res.end_s["x"]


def test_swap_out_on_copy_stream_overlaps_the_next_compute():
    # fwd1 (2 s) writes a 100-byte activation that is swapped out (1 s on d2h) while fwd2
    # (2 s) computes: makespan 4 s, not the 5 s of doing the copy on the compute stream.
    def build(copy_stream):
        sim = Simulator()
        sim.add_task("fwd1", "dev0.compute", 2.0, alloc=[("dev0", 100)])
        sim.add_task("swap1", copy_stream, 1.0, deps=["fwd1"], free=[("dev0", 100)],
                     alloc=[("host0", 100)])
        sim.add_task("fwd2", "dev0.compute", 2.0, deps=["fwd1"], alloc=[("dev0", 100)])
        return sim.run()

    overlapped, serial = build("dev0.d2h"), build("dev0.compute")
    assert (overlapped.makespan_s, serial.makespan_s) == (4.0, 5.0)
    assert overlapped.start_s["swap1"] == overlapped.start_s["fwd2"] == 2.0
    assert overlapped.peak_memory_bytes["dev0"] == 200
    assert overlapped.peak_time_s["dev0"] == 2.0
    np.testing.assert_array_equal(overlapped.memory_timeline["dev0"].bytes, [0, 100, 200, 100])
    assert overlapped.peak_memory_bytes["host0"] == 100


def test_priority_breaks_ties_and_fifo_beats_priority():
    sim = Simulator()
    sim.add_task("x", "r", 1.0, priority=2)
    sim.add_task("y", "r", 1.0, priority=1)
    sim.add_task("z", "r", 1.0, priority=1)
    res = sim.run()
    assert sorted("xyz", key=res.start_s.get) == ["y", "z", "x"]

    # "late" is ready at 1.0 with the better priority, "early" at 0.5: FIFO starts "early".
    def build(policy):
        sim = Simulator()
        sim.add_resource("r", policy=policy)
        sim.add_task("busy", "r", 2.0)
        sim.add_task("early", "r", 1.0, priority=5, earliest_start_s=0.5)
        sim.add_task("late", "r", 1.0, priority=0, earliest_start_s=1.0)
        return sim.run()

    assert (build("fifo").start_s["early"], build("fifo").start_s["late"]) == (2.0, 3.0)
    assert (build("priority").start_s["late"], build("priority").start_s["early"]) == (2.0, 3.0)


def test_capacity_two_resource_runs_two_tasks_at_once():
    sim = Simulator()
    sim.add_resource("dma", capacity=2)
    for i in range(3):
        sim.add_task(f"t{i}", "dma", 1.0)
    res = sim.run()
    assert [res.start_s[f"t{i}"] for i in range(3)] == [0.0, 0.0, 1.0]
    assert res.busy_s["dma"] == 3.0
    assert res.utilization["dma"] == 3.0 / (2 * 2.0)


def test_busy_time_and_utilization_per_resource():
    sim = Simulator()
    sim.add_task("a", "r0", 1.0)
    sim.add_task("b", "r1", 2.0, deps=["a"])
    sim.add_task("c", "r0", 3.0, deps=["b"])
    res = sim.run()
    assert res.busy_s == {"r0": 4.0, "r1": 2.0}
    assert res.utilization == {"r0": 4.0 / 6.0, "r1": 2.0 / 6.0}


def test_resourceless_events_and_earliest_start():
    sim = Simulator()
    sim.add_task("a", "r0", 1.0)
    sim.add_task("b", "r1", 2.0)
    sim.add_event("join", deps=["a", "b"])
    sim.add_task("delay", None, 0.5, deps=["join"])  # no resource: a pure delay
    sim.add_task("c", "r0", 1.0, deps=["delay"], earliest_start_s=4.0)
    res = sim.run()
    assert (res.end_s["join"], res.end_s["delay"], res.start_s["c"]) == (2.0, 2.5, 4.0)
    assert "join" not in res.busy_s and None not in res.busy_s
    assert res.critical_path() == ["c"]  # c started at its earliest_start_s


# ---------------------------------------------------------------- memory
def test_memory_peak_and_its_time_with_overlapping_tasks():
    sim = Simulator()
    sim.set_initial_memory("dev0", 1000)
    sim.add_task("a", "r0", 4.0, alloc=[("dev0", 300)], free=[("dev0", 300)])
    sim.add_task("b", "r1", 2.0, alloc=[("dev0", 200)], free=[("dev0", 200)], earliest_start_s=1.0)
    sim.add_task("c", "r2", 3.0, alloc=[("dev0", 100)], free=[("dev0", 100)], earliest_start_s=2.0)
    res = sim.run()
    assert (res.peak_memory_bytes["dev0"], res.peak_time_s["dev0"]) == (1600, 2.0)
    tl = res.memory_timeline["dev0"]
    np.testing.assert_array_equal(tl.times_s, [0, 0, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(tl.bytes, [1000, 1300, 1500, 1600, 1400, 1100, 1000])
    assert res.fits_memory


def test_frees_are_applied_before_allocs_at_the_same_time():
    sim = Simulator()
    sim.set_memory_capacity("dev0", 100)
    sim.add_task("a", "r", 2.0, alloc=[("dev0", 100)], free=[("dev0", 100)])
    sim.add_task("b", "r", 2.0, deps=["a"], alloc=[("dev0", 100)], free=[("dev0", 100)])
    sim.add_event("scratch", deps=["a"], alloc=[("dev0", 50)], free=[("dev0", 50)])
    res = sim.run()
    assert res.peak_memory_bytes["dev0"] == 100  # max(a, b), not a + b; scratch cancels
    assert res.memory_violations == []


def test_capacity_violation_is_reported_with_its_first_time():
    sim = Simulator()
    sim.set_memory_capacity("dev0", 150)
    sim.set_initial_memory("dev1", 10)
    sim.set_memory_capacity("dev1", 5)
    sim.add_task("a", "r0", 3.0, alloc=[("dev0", 100)], free=[("dev0", 100)])
    sim.add_task("b", "r1", 1.0, alloc=[("dev0", 100)], free=[("dev0", 100)], earliest_start_s=1.0)
    res = sim.run()
    assert not res.fits_memory
    v0, v1 = res.memory_violations
    assert (v0.device, v0.peak_bytes, v0.excess_bytes, v0.first_time_s) == ("dev0", 200, 50, 1.0)
    assert (v1.device, v1.first_time_s, v1.excess_bytes) == ("dev1", 0.0, 5)


def test_freeing_more_than_was_allocated_is_an_error():
    sim = Simulator()
    sim.set_initial_memory("dev0", 10)
    sim.add_task("a", "r", 1.0, free=[("dev0", 20)])
    with pytest.raises(ValueError, match="dev0.*-10 bytes at t=1"):
        sim.run()


# ---------------------------------------------------------------- errors
def test_cycle_is_reported_with_the_tasks_on_it():
    sim = Simulator()
    sim.add_task("ok", "r", 1.0)
    sim.add_task("a", "r", 1.0, deps=["ok", "c"])
    sim.add_task("b", "r", 1.0, deps=["a"])
    sim.add_task("c", "r", 1.0, deps=["b"])
    with pytest.raises(ValueError, match=r"dependency cycle.*'a' -> 'c' -> 'b' -> 'a'"):
        sim.run()
    sim = Simulator()
    sim.add_task("self", "r", 1.0, deps=["self"])
    with pytest.raises(ValueError, match="'self' -> 'self'"):
        sim.run()


def test_unknown_dependency_names_the_task():
    sim = Simulator()
    sim.add_task("a", "r", 1.0, deps=["ghost"])
    with pytest.raises(ValueError, match="task 'a' depends on unknown task 'ghost'"):
        sim.run()


@pytest.mark.parametrize("kwargs, message", [
    (dict(duration_s=-1.0), r"'duration_s' of task 't' must be .* but got -1.0"),
    (dict(duration_s=float("nan")), r"'duration_s' of task 't'"),
    (dict(alloc=[("dev0", -5)]), r"'alloc' bytes of task 't' on 'dev0' .* but got -5"),
    (dict(free=[("dev0",)]), r"'free' of task 't' must hold \(device, bytes\) pairs"),
    (dict(earliest_start_s=-2), r"'earliest_start_s' of task 't' .* but got -2"),
])
def test_bad_task_arguments_raise_value_error_naming_the_field(kwargs, message):
    args = dict(name="t", resource="r", duration_s=1.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        Simulator().add_task(**args)


def test_bad_transfer_and_resource_arguments():
    sim = Simulator()
    with pytest.raises(ValueError, match="transfer 'x': 'bandwidth_Bps' .* but got 0"):
        sim.add_transfer("x", "link", MB, ALPHA, 0)
    with pytest.raises(ValueError, match="transfer 'x': 'nbytes' .* but got -1"):
        sim.add_transfer("x", "link", -1, ALPHA, GBps)
    with pytest.raises(ValueError, match="'capacity' of resource 'r' must be an int >= 1"):
        sim.add_resource("r", capacity=0)
    sim.add_task("t", "r", 1.0)
    with pytest.raises(ValueError, match="task name 't' is already used"):
        sim.add_task("t", "r", 1.0)


# ---------------------------------------------------------------- equivalence, determinism, speed
def _naive_schedule(tasks, capacity):
    """Time-stepping reference: at each event time, end tasks, start ready resource-less
    tasks until nothing changes, then fill each resource by (ready time, priority, index)."""
    n = len(tasks)
    start, end = [None] * n, [None] * n
    t = 0.0
    while any(e is None for e in end):
        changed = True
        while changed:  # resource-less tasks (possibly zero-duration) resolve at time t
            changed = False
            for i, tk in enumerate(tasks):
                if start[i] is not None and end[i] is None and start[i] + tk["dur"] <= t:
                    end[i], changed = start[i] + tk["dur"], True
            for i, tk in enumerate(tasks):
                if tk["res"] is None and start[i] is None and _ready(i, tasks, end) is not None \
                        and _ready(i, tasks, end) <= t:
                    start[i], changed = t, True
        for r in sorted(capacity):
            busy = sum(1 for i, tk in enumerate(tasks)
                       if tk["res"] == r and start[i] is not None and end[i] is None)
            waiting = sorted((_ready(i, tasks, end), tk["prio"], i) for i, tk in enumerate(tasks)
                             if tk["res"] == r and start[i] is None
                             and _ready(i, tasks, end) is not None and _ready(i, tasks, end) <= t)
            for _, _, i in waiting[:capacity[r] - busy]:
                start[i] = t
        upcoming = [start[i] + tk["dur"] for i, tk in enumerate(tasks)
                    if start[i] is not None and end[i] is None]
        upcoming += [tk["earliest"] for i, tk in enumerate(tasks)
                     if start[i] is None and tk["earliest"] > t]
        t = min(upcoming, default=t)
    return start, end


def _ready(i, tasks, end):
    if any(end[d] is None for d in tasks[i]["deps"]):
        return None
    return max([tasks[i]["earliest"]] + [end[d] for d in tasks[i]["deps"]])


@pytest.mark.parametrize("seed", range(12))
def test_random_dags_match_the_naive_scheduler(seed):
    rng = np.random.default_rng(seed)
    capacity = {"r0": 1, "r1": 1, "r2": 2}
    tasks = []
    for i in range(40):
        res = [None, "r0", "r1", "r2"][rng.integers(4)]
        tasks.append(dict(
            res=res, prio=int(rng.integers(3)),
            dur=float(rng.integers(0 if res is None else 1, 5)),  # exact in binary
            earliest=float(rng.integers(6)) if rng.random() < 0.2 else 0.0,
            deps=sorted(set(rng.choice(i, size=min(i, rng.integers(3)), replace=False).tolist())),
            nbytes=int(rng.integers(1, 100))))
    sim = Simulator()
    sim.add_resource("r2", capacity=2)
    for i, tk in enumerate(tasks):
        sim.add_task(f"t{i}", tk["res"], tk["dur"], deps=tk["deps"], priority=tk["prio"],
                     earliest_start_s=tk["earliest"], alloc=[("dev0", tk["nbytes"])],
                     free=[("dev0", tk["nbytes"])])
    res = sim.run()
    start, end = _naive_schedule(tasks, capacity)
    assert [res.start_s[f"t{i}"] for i in range(len(tasks))] == start
    assert res.makespan_s == max(end)
    # peak = max over event times of the level after all frees and allocs at that time
    levels = [sum(tk["nbytes"] for i, tk in enumerate(tasks) if start[i] <= t < end[i])
              for t in sorted(set(start + end))]
    assert res.peak_memory_bytes["dev0"] == max(levels)


def _layered_pipeline(num_devices, num_layers):
    """Per device: a chain of forward layers on compute; each activation swapped out on d2h
    (the same builder scripts/bench_sim.py times)."""
    from scripts.bench_sim import build

    return build(num_devices, num_layers)


def test_same_inputs_give_identical_results():
    a, b = _layered_pipeline(2, 50).run(), _layered_pipeline(2, 50).run()
    assert (a.start_s, a.end_s, a.busy_s, a.peak_memory_bytes) == \
        (b.start_s, b.end_s, b.busy_s, b.peak_memory_bytes)
    np.testing.assert_array_equal(a.memory_timeline["dev1"].bytes, b.memory_timeline["dev1"].bytes)
    assert a.critical_path() == b.critical_path()


def test_twenty_thousand_tasks_give_the_hand_computed_bottleneck():
    # (its speed is a benchmark figure, scripts/bench_sim.py, not a test: a busy machine
    # would fail a wall-clock assertion)
    sim = _layered_pipeline(num_devices=4, num_layers=2500)
    res = sim.run()
    assert len(sim) == 20_000
    # A swap (4e6 / 25e9 + 10 us = 0.17 ms) is slower than a 0.1 ms layer, so the d2h stream
    # is the bottleneck: 2500 swaps back to back after the first layer; activations pile up.
    swap = transfer_time_s(4e6, ALPHA, 25e9)
    assert res.makespan_s == pytest.approx(1e-4 + 2500 * swap, rel=1e-9)
    assert res.utilization["dev0.d2h"] == pytest.approx(2500 * swap / res.makespan_s)
    assert res.memory_violations[0].device == "dev0"
