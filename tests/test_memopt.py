"""MemOpt: layer model, simulator environment, baselines, MILPs, RL agents, plan files, CLI."""
import itertools
import subprocess
import sys

import numpy as np
import pytest
import yaml

from ms_efficient.collectives import Link
from ms_efficient.memopt.agents import RLConfig, train_agents
from ms_efficient.memopt.apply import plan_to_dict, plan_from_dict
from ms_efficient.memopt.baselines import (capuchin_greedy, chen_segments, chen_sqrt,
                                           full_recompute, no_optimization)
from ms_efficient.memopt.env import (KEEP, RECOMPUTE, RECOMPUTE_ALL, SWAP, MemoryPlan,
                                     evaluate, min_budget_bytes, plan_from_names)
from ms_efficient.memopt.milp import checkmate_milp, exact_milp
from ms_efficient.memopt.planner import plan_memory
from ms_efficient.memopt.profile import LayerProfile, parse_size, profile_from_graph

LINK = Link(latency_s=0.0, bandwidth_Bps=100.0)


def three_layers():
    """f = 1, 2, 1 s; b = 2, 4, 2 s; o = 10 B; e = 100, 50, 100 B; w = 20 B; static 1000 B."""
    return LayerProfile(names=["a", "b", "c"], forward_time_s=np.array([1.0, 2.0, 1.0]),
                        backward_time_s=np.array([2.0, 4.0, 2.0]),
                        output_bytes=np.full(3, 10.0), interior_bytes=np.array([100.0, 50, 100]),
                        workspace_bytes=np.full(3, 20.0), static_bytes=1000.0)


def random_profile(n, seed):
    rng = np.random.default_rng(seed)
    return LayerProfile(names=[f"l{i}" for i in range(n)], forward_time_s=rng.uniform(1, 3, n),
                        backward_time_s=rng.uniform(2, 6, n), output_bytes=rng.uniform(5, 20, n),
                        interior_bytes=rng.uniform(20, 100, n),
                        workspace_bytes=rng.uniform(5, 20, n), static_bytes=100.0)


def test_keep_all_peaks_at_last_backward_with_every_activation():
    r = evaluate(three_layers(), MemoryPlan([KEEP] * 3), 2000, LINK)
    # 1000 static + (110 + 60 + 110) activations + 20 workspace of backward c
    assert r.peak_bytes == 1300 and r.step_time_s == 12.0


def test_recompute_all_layers_costs_one_forward_and_keeps_only_outputs():
    r = evaluate(three_layers(), MemoryPlan([RECOMPUTE] * 3), 2000, LINK)
    # backward c: static + o_a + o_b + (o_c + e_c rebuilt) + w_c = 1000 + 10 + 10 + 110 + 20
    assert r.peak_bytes == 1150 and r.step_time_s == 16.0 and r.recompute_time_s == 4.0


def test_swap_of_first_layer_hides_its_page_out_but_prefetch_lead_zero_is_exposed():
    prof = three_layers()
    hidden = evaluate(prof, MemoryPlan([SWAP, KEEP, KEEP], prefetch_lead=[1, 1, 1]), 2000, LINK)
    exposed = evaluate(prof, MemoryPlan([SWAP, KEEP, KEEP], prefetch_lead=[0, 0, 0]), 2000, LINK)
    assert hidden.step_time_s == 12.0            # 110 B at 100 B/s behind backward c (2 s)
    assert exposed.step_time_s == pytest.approx(13.1)   # 1.1 s prefetch on the critical path
    assert exposed.peak_bytes == 1190            # layer a is off the device during backward c


def test_min_budget_is_static_plus_largest_layer_working_set():
    assert min_budget_bytes(three_layers()) == 1000 + 10 + 110 + 20


def test_budget_below_minimum_names_the_minimum():
    with pytest.raises(ValueError, match=r"below the minimum feasible budget .*1140 bytes"):
        plan_memory(three_layers(), 1100, LINK)


def test_chen_sqrt_uses_ceil_sqrt_n_segments():
    prof = random_profile(16, 0)
    plan = chen_sqrt(prof)
    assert chen_segments(16) == 4
    assert int(np.sum(plan.actions == RECOMPUTE)) == 4
    assert int(np.sum(plan.actions == RECOMPUTE_ALL)) == 12


def test_checkmate_milp_equals_brute_force_optimum_on_six_layers():
    prof = random_profile(6, 3)
    none = evaluate(prof, no_optimization(prof), 1e9, LINK).peak_bytes
    low = min_budget_bytes(prof)
    budget = low + 0.35 * (none - low)
    best = min(evaluate(prof, MemoryPlan(np.array(c)), budget, LINK).step_time_s
               for c in itertools.product((KEEP, RECOMPUTE, RECOMPUTE_ALL), repeat=6)
               if evaluate(prof, MemoryPlan(np.array(c)), budget, LINK).fits)
    plan = checkmate_milp(prof, budget, LINK)
    r = evaluate(prof, plan, budget, LINK)
    assert r.fits and r.step_time_s == pytest.approx(best)
    assert plan.meta["objective_s"] + prof.forward_time_s.sum() + prof.backward_time_s.sum() \
        == pytest.approx(r.step_time_s)


def test_exact_milp_is_never_slower_than_recompute_only_and_fits():
    prof = random_profile(7, 1)
    none = evaluate(prof, no_optimization(prof), 1e9, LINK).peak_bytes
    budget = min_budget_bytes(prof) + 0.35 * (none - min_budget_bytes(prof))
    link = Link(0.0, 40.0)
    rc = evaluate(prof, checkmate_milp(prof, budget, link), budget, link)
    ex = evaluate(prof, exact_milp(prof, budget, link), budget, link)
    assert ex.fits and ex.step_time_s <= rc.step_time_s + 1e-9


def test_rl_agents_are_reproducible_fit_and_match_the_milp_within_3_percent():
    prof = random_profile(10, 5)
    none = evaluate(prof, no_optimization(prof), 1e9, LINK).peak_bytes
    budget = min_budget_bytes(prof) + 0.4 * (none - min_budget_bytes(prof))
    cfg = RLConfig(seed=3, iterations=30, batch=8)
    runs = [plan_memory(prof, budget, LINK, cfg) for _ in range(2)]
    assert np.array_equal(runs[0][0].actions, runs[1][0].actions)
    milp = evaluate(prof, exact_milp(prof, budget, LINK), budget, LINK)
    assert runs[0][1].fits and runs[0][1].peak_bytes <= budget
    assert runs[0][1].step_time_s <= 1.03 * milp.step_time_s


def test_rl_from_scratch_improves_on_its_first_batch():
    prof = random_profile(8, 2)
    none = evaluate(prof, no_optimization(prof), 1e9, LINK).peak_bytes
    budget = min_budget_bytes(prof) + 0.5 * (none - min_budget_bytes(prof))
    plan, result, hist = train_agents(prof, budget, LINK, None, RLConfig(seed=0, iterations=40))
    assert plan is not None and result.fits
    assert hist["mean_reward"][-1] > hist["mean_reward"][0]


def test_capuchin_swaps_only_what_hides_and_fits():
    prof = random_profile(8, 4)
    none = evaluate(prof, no_optimization(prof), 1e9, LINK).peak_bytes
    budget = min_budget_bytes(prof) + 0.6 * (none - min_budget_bytes(prof))
    plan = capuchin_greedy(prof, budget, Link(0.0, 1e4))
    assert plan.meta["fits"] and evaluate(prof, plan, budget, Link(0.0, 1e4)).fits


def test_full_recompute_uses_less_memory_than_none():
    prof = random_profile(8, 6)
    assert evaluate(prof, full_recompute(prof), 1e9, LINK).peak_bytes < \
        evaluate(prof, no_optimization(prof), 1e9, LINK).peak_bytes


def test_parse_size_units_and_errors():
    assert parse_size("12GiB") == 12 * 2**30
    assert parse_size("800MB") == 800_000_000
    assert parse_size(1024) == 1024
    with pytest.raises(ValueError, match="'--budget' must be a size"):
        parse_size("12 parsecs", "--budget")


def test_unknown_layer_name_is_rejected():
    with pytest.raises(ValueError, match="unknown layer name 'zz'"):
        plan_from_names(three_layers(), {"zz": "recompute"})


def test_plan_round_trips_through_yaml_with_mindformers_sections():
    prof = three_layers()
    plan = MemoryPlan([RECOMPUTE, SWAP, KEEP], prefetch_lead=[1, 2, 1], method="memopt")
    doc = yaml.safe_load(yaml.safe_dump(plan_to_dict(prof, plan, None, 2000)))
    names, back = plan_from_dict(doc)
    assert names == ["a", "b", "c"] and list(back.actions) == [RECOMPUTE, SWAP, KEEP]
    assert doc["recompute_config"]["recompute"] == ["a"]
    assert doc["swap_config"]["op_swap"][0] == {"op_name": "b", "backward_prefetch": 2,
                                                "swap_out_delay": 0}


def test_profile_from_malformed_graph_raises():
    from ms_efficient.graph import OpGraph

    with pytest.raises(ValueError, match="has no nodes"):
        profile_from_graph(OpGraph(name="empty"))


def test_profile_from_pipedream_text_groups_layers():
    from ms_efficient.graph import parse_pipedream

    text = "".join(f"node{i} -- ReLU() -- forward_compute_time=1.0, backward_compute_time=2.0, "
                   f"activation_size=100.0, parameter_size=10.0\n" for i in range(6))
    text += "".join(f"\tnode{i} -- node{i + 1}\n" for i in range(5))
    prof = profile_from_graph(parse_pipedream(text), max_layers=3)
    assert prof.num_layers == 3
    assert prof.forward_time_s.sum() == pytest.approx(6e-3)
    assert prof.activation_bytes.sum() == pytest.approx(600.0)


def test_cli_plan_memory_budget_below_minimum_exits_2(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {num_layers: 2, hidden_size: 64, num_heads: 2, seq_length: 32}\n"
                   "train: {batch_size: 4}\ncluster: {preset: ascend910b-1x8}\n")
    proc = subprocess.run([sys.executable, "-m", "ms_efficient.cli", "plan", "memory", str(cfg),
                           "--budget", "1KB", "--out", str(tmp_path / "p.yaml")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "minimum feasible budget" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "ms_efficient.cli", "plan", "memory", str(cfg),
                           "--budget", "1GiB", "--out", str(tmp_path / "p.yaml")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load((tmp_path / "p.yaml").read_text())["kind"] == "memopt"


@pytest.mark.slow
def test_apply_plan_sets_recompute_and_swap_flags_on_reference_cells():
    from ms_efficient.config import ModelConfig, MoEConfig
    from ms_efficient.memopt.apply import apply_plan
    from ms_efficient.models.gpt_moe import build_model
    from ms_efficient.passes import registered_passes

    net = build_model(ModelConfig(num_layers=2, hidden_size=32, num_heads=2, seq_length=16,
                                  ffn_hidden_size=64), MoEConfig(num_experts=2, top_k=1), 2)
    names = ["blocks.0.attn", "blocks.0.ffn", "blocks.1.attn", "blocks.1.ffn"]
    applied = apply_plan(net, names, MemoryPlan([RECOMPUTE, SWAP, KEEP, RECOMPUTE_ALL]))
    assert applied == {"recompute": ["blocks.0.attn", "blocks.1.ffn"], "swap": ["blocks.0.ffn"]}
    assert net.blocks[0].ffn.get_flags()["memopt_swap"] is True
    assert "memopt" in registered_passes()
    with pytest.raises(ValueError, match="unknown Cells"):
        apply_plan(net, ["blocks.9.attn"], MemoryPlan([RECOMPUTE]))


@pytest.mark.slow
def test_measured_recompute_plan_runs_below_the_unoptimised_peak():
    from ms_efficient.memopt.measure import measure_plan

    model = dict(vocab_size=64, seq_length=64, hidden_size=64, num_layers=2, num_heads=4,
                 ffn_hidden_size=128)
    moe = dict(num_experts=2, top_k=1)
    none = measure_plan(model, moe, 8, [], steps=1)
    full = measure_plan(model, moe, 8, ["blocks.0.attn", "blocks.0.ffn", "blocks.1.attn",
                                        "blocks.1.ffn"], steps=1)
    assert none["peak_bytes"] > 0 and full["step_time_s"] > 0
