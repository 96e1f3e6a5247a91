import numpy as np
import pytest

from mindspore import nn

import ms_efficient
from ms_efficient.core.config import config_from_dict
from ms_efficient.passes import register_pass, registered_passes


def _params(net):
    return {p.name: p.asnumpy().copy() for p in net.get_parameters()}


def test_optimize_with_no_pass_changes_nothing():
    net = nn.SequentialCell([nn.Dense(8, 4), nn.ReLU(), nn.Dense(4, 2)])
    before = _params(net)
    cells_before = [name for name, _ in net.cells_and_names()]
    out, plans = ms_efficient.optimize(net, config_from_dict({}))
    assert out is net and plans == {}
    assert [name for name, _ in out.cells_and_names()] == cells_before
    after = _params(out)
    assert before.keys() == after.keys()
    for name in before:
        np.testing.assert_array_equal(before[name], after[name])


def test_enabled_passes_run_in_order_and_return_their_plans():
    calls = []

    @register_pass("test-mark-a")
    def mark_a(network, context):
        calls.append("a")
        network.marked = "a"
        return network, {"kind": "a", "cells": {"": {"marked": "a"}}}

    @register_pass("test-mark-b")
    def mark_b(network, context):
        calls.append("b")
        return network, {"saw": network.marked, "cells": {"": {}}}

    cfg = config_from_dict({"optimize": {"passes": ["test-mark-b", "test-mark-a"]}})
    cfg.optimize.passes = ["test-mark-a", "test-mark-b"]
    net = nn.Dense(2, 2)
    out, plans = ms_efficient.optimize(net, cfg)
    assert calls == ["a", "b"]
    assert plans["test-mark-a"]["kind"] == "a" and plans["test-mark-b"]["saw"] == "a"
    assert "test-mark-a" in registered_passes()


def test_a_name_can_only_be_registered_once():
    @register_pass("test-unique")
    def first(network, context):
        return network, None

    with pytest.raises(ValueError, match="pass 'test-unique' is already registered"):
        @register_pass("test-unique")
        def second(network, context):
            return network, None


def test_optimize_rejects_other_configs():
    with pytest.raises(TypeError, match="RunConfig or a config path"):
        ms_efficient.optimize(nn.Dense(2, 2), {"optimize": {}})


def test_a_pass_whose_plan_names_no_changed_cell_is_refused():
    @register_pass("test-silent")
    def silent(network, context):
        return network, {"kind": "silent", "cells": {}}

    cfg = config_from_dict({})
    cfg.optimize.passes = ["test-silent"]
    with pytest.raises(ValueError, match="pass 'test-silent' returned a plan that names no "
                                         "changed Cell"):
        ms_efficient.optimize(nn.Dense(2, 2), cfg)
