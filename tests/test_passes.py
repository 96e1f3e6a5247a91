import logging

import numpy as np
import pytest

from mindspore import nn

import ms_efficient
from ms_efficient.core.config import config_from_dict
from ms_efficient.passes import (PassRefused, applied_plans, refusals, register_pass,
                                 registered_passes)


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


def test_a_pass_whose_plan_names_no_changed_cell_is_refused(caplog):
    @register_pass("test-silent")
    def silent(network, context):
        return network, {"kind": "silent", "cells": {}}

    cfg = config_from_dict({})
    cfg.optimize.passes = ["test-silent"]
    reason = ("pass 'test-silent' returned a plan that names no changed Cell (its 'cells' is "
              "empty): it changed nothing; a pass with nothing to change must raise "
              "PassRefused saying what it looked for.")
    with caplog.at_level(logging.WARNING, logger="ms_efficient.passes"):
        _, plans = ms_efficient.optimize(nn.Dense(2, 2), cfg)
    assert plans == {"test-silent": {"refused": reason}}          # a refusal, not a change
    assert "pass test-silent refused" in caplog.text and reason in caplog.text
    with pytest.raises(PassRefused) as err:
        ms_efficient.optimize(nn.Dense(2, 2), cfg, strict=True)
    assert str(err.value) == reason and isinstance(err.value, ValueError)


# Three passes: one that sets an attribute, one that refuses (after looking at the network,
# changing nothing), one that reads what the first set and the plans before it.
@register_pass("test-apply-1")
def _apply_1(network, context):
    network.tagged = 1
    return network, {"kind": "one", "cells": {"": {"tagged": 1}}}


@register_pass("test-refuse")
def _refuse(network, context):
    raise PassRefused("test-refuse: found no Cell of class Foo; nothing to change.")


@register_pass("test-apply-2")
def _apply_2(network, context):
    return network, {"saw": network.tagged, "before": sorted(context.plans),
                     "refused_before": dict(context.refused), "cells": {"": {}}}


def test_a_refused_pass_is_recorded_and_the_others_apply(caplog):
    cfg = config_from_dict({})
    cfg.optimize.passes = ["test-apply-1", "test-refuse", "test-apply-2"]
    net = nn.Dense(2, 2)
    with caplog.at_level(logging.WARNING, logger="ms_efficient.passes"):
        out, plans = ms_efficient.optimize(net, cfg)
    reason = "test-refuse: found no Cell of class Foo; nothing to change."
    assert out is net and net.tagged == 1
    assert list(plans) == ["test-apply-1", "test-refuse", "test-apply-2"]
    assert plans["test-refuse"] == {"refused": reason}
    assert plans["test-apply-1"] == {"kind": "one", "cells": {"": {"tagged": 1}}}
    # the pass after the refusal plans against the applied plans only
    assert plans["test-apply-2"]["before"] == ["test-apply-1"]
    assert plans["test-apply-2"]["refused_before"] == {"test-refuse": reason}
    assert list(applied_plans(plans)) == ["test-apply-1", "test-apply-2"]
    assert refusals(plans) == {"test-refuse": reason}
    assert caplog.records[-1].levelname == "WARNING" and reason in caplog.text
    # strict=True raises the refusal itself; the pass before it has already applied
    net = nn.Dense(2, 2)
    with pytest.raises(PassRefused, match="^test-refuse: found no Cell of class Foo"):
        ms_efficient.optimize(net, cfg, strict=True)
    assert net.tagged == 1
    with pytest.raises(TypeError, match="'strict' must be True or False, but got 'yes'"):
        ms_efficient.optimize(nn.Dense(2, 2), cfg, strict="yes")


def test_an_error_of_a_pass_is_not_a_refusal():
    @register_pass("test-broken")
    def broken(network, context):
        raise ValueError("'optimize.micro_batches' must divide the batch size 8, but got 3.")

    cfg = config_from_dict({})
    cfg.optimize.passes = ["test-broken"]
    with pytest.raises(ValueError, match="'optimize.micro_batches' must divide") as err:
        ms_efficient.optimize(nn.Dense(2, 2), cfg)
    assert not isinstance(err.value, PassRefused)


def test_verify_with_every_pass_refused_checks_nothing_and_says_so(caplog):
    cfg = config_from_dict({})
    cfg.optimize.passes = ["test-refuse"]
    with caplog.at_level(logging.WARNING, logger="ms_efficient.passes"):
        _, plans = ms_efficient.optimize(nn.Dense(2, 2), cfg, verify=True)
    assert list(plans) == ["test-refuse"] and "verified" not in plans["test-refuse"]
    assert "every pass refused (test-refuse); the network is unchanged" in caplog.text
