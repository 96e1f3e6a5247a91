"""The memory budget's feasible floor (issue 25): ``budget_floor`` by enumeration on a small
profile, and ``plan memory --budget`` taking what ``optimize.memory_budget`` takes (no
MindSpore)."""
import itertools

import numpy as np
import pytest
import yaml

from ms_efficient.memopt.env import (ALL_ACTIONS, CELL_RECOMPUTE_ACTIONS, KEEP, RECOMPUTE,
                                     MemoryPlan, evaluate, min_budget_bytes)
from ms_efficient.memopt.planner import budget_floor, plan_memory
from tests.test_memopt import LINK, three_layers


def test_budget_floor_is_the_least_recompute_peak_and_a_budget_there_plans():
    prof = three_layers()
    peaks = {acts: evaluate(prof, MemoryPlan(np.array(acts)), float("inf"), LINK).peak_bytes
             for acts in itertools.product((KEEP, RECOMPUTE), repeat=3)}
    floor, safe, least = budget_floor(prof, LINK, CELL_RECOMPUTE_ACTIONS)
    assert floor == safe == min(peaks.values())
    assert evaluate(prof, least, float("inf"), LINK).peak_bytes == floor
    # with swap the floor is static + the largest one-layer working set (1000 + 140)
    low, safe_all, _ = budget_floor(prof, LINK, ALL_ACTIONS)
    assert low == min_budget_bytes(prof) == 1140 and safe_all >= low
    plan, result = plan_memory(prof, safe, LINK, actions=CELL_RECOMPUTE_ACTIONS,
                               candidates={"checkmate-milp": least})
    assert result.fits and result.peak_bytes <= safe


def test_cli_plan_memory_budget_takes_what_optimize_takes_and_names_the_floor(tmp_path, capsys):
    from ms_efficient.cli import main
    from ms_efficient.core.cluster import get_cluster
    from ms_efficient.core.units import format_size

    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {num_layers: 2, hidden_size: 64, num_heads: 2, seq_length: 32}\n"
                   "train: {batch_size: 4}\ncluster: {preset: ascend910b-1x8}\n")
    out = tmp_path / "p.yaml"
    # the floor by hand from the profile: static + the largest o_{i-1} + o_i + e_i + w_i
    from ms_efficient.core.config import load_config
    from ms_efficient.memopt.profile import profile_from_model

    conf = load_config(str(cfg))
    cluster = get_cluster("ascend910b-1x8")
    prof = profile_from_model(conf.model, conf.moe, 4, cluster)
    o = prof.output_bytes
    floor = prof.static_bytes + max((o[i - 1] if i else 0.0) + o[i] + prof.interior_bytes[i]
                                    + 2 * o[i] for i in range(prof.num_layers))
    peak = evaluate(prof, MemoryPlan(np.zeros(prof.num_layers, int)), float("inf"),
                    cluster.host_link).peak_bytes
    pct = np.ceil(floor / peak * 1000) / 10
    # a share below the floor: one line, exit 2, the floor as a share and in bytes
    assert main(["plan", "memory", str(cfg), "--budget", "5%", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and not out.exists()
    assert (f"'--budget' (5%, {format_size(0.05 * peak)}) is below the feasible floor "
            f"{pct:.1f}% ({format_size(floor)}) of the unoptimised peak {format_size(peak)}"
            in err[0])
    # the suggested share plans (exit 0) within its budget
    suggested = err[0].split("at least '")[1].split("'")[0]
    assert float(suggested[:-1]) >= pct
    assert main(["plan", "memory", str(cfg), "--budget", suggested, "--out", str(out)]) == 0
    doc = yaml.safe_load(out.read_text())
    assert doc["budget_bytes"] == pytest.approx(float(suggested[:-1]) / 100 * peak, abs=1)
    assert doc["simulated"]["fits"] and doc["simulated"]["peak_bytes"] <= doc["budget_bytes"]
    # a bad value: the message optimize() gives for optimize.memory_budget, named --budget
    capsys.readouterr()
    assert main(["plan", "memory", str(cfg), "--budget", "150%", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(
        "'--budget' must be a percentage in (0%, 100%], a size like 12GiB or a number of "
        "bytes, but got '150%'.")
