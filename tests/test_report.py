"""The run report (ms_efficient.train.report) on hand-made run folders: no training.

An expert-parallel run of 3 logged steps x 2 MoE layers x 2 devices, with these rows per
device (and so device max / mean = max / mean of the two):

    step 1: layer 0 [6, 4] -> 1.2   layer 1 [5, 5] -> 1.0   devices summed [11,  9]
    step 2: layer 0 [8, 2] -> 1.6   layer 1 [7, 3] -> 1.4   devices summed [15,  5]
    step 3: layer 0 [4, 6] -> 1.2   layer 1 [9, 1] -> 1.8   devices summed [13,  7]

Over the 6 layer-steps, sorted 1.0 1.2 1.2 1.4 1.6 1.8: p50 = (1.2 + 1.4) / 2 = 1.3,
p95 = 1.6 + 0.75 * (1.8 - 1.6) = 1.75 (rank 0.95 * 5 = 4.75), max 1.8. The last step alone
would give p50 1.5, p95 1.77.
"""
import json
import os
import struct

import numpy as np
import pytest
import yaml

from ms_efficient.train import report
from ms_efficient.train.report import (balance_percentiles, device_load_matrix,
                                       device_load_missing_reason, run_device,
                                       summary_scalars, write_report)

ROWS_PER_DEVICE = {1: ([6, 4], [5, 5]), 2: ([8, 2], [7, 3]), 3: ([4, 6], [9, 1])}


def _ep_rows():
    rows = [{"kind": "val", "step": 0, "val_loss": 5.5}]
    for step, layers in ROWS_PER_DEVICE.items():
        balance = []
        for layer, per_device in enumerate(layers):
            mean = np.mean(per_device)
            balance.append({"layer": layer, "expert_max_over_mean": 1.0 + layer,
                            "expert_cv": 0.1, "dead_experts": 0, "dropped": 0,
                            "rows_per_device": per_device,
                            "device_max_over_mean": round(max(per_device) / mean, 4),
                            "device_cv": round(float(np.std(per_device)) / mean, 4)})
        rows.append({"kind": "train", "step": step, "loss": 5.0 - step, "ce": 4.9 - step,
                     "tokens_per_s": 100.0 * step, "drop_rate": 0.01 * step,
                     "balance": balance})
        if step == 2:
            rows.append({"kind": "replan", "step": 2, "seconds": 0.5, "moved_slots": 2,
                         "moved_bytes": 1024, "state_bytes": 2048, "reason": "forced"})
    rows.append({"kind": "val", "step": 3, "val_loss": 2.5})
    return rows


def _one_process_rows():
    return [{"kind": "train", "step": step, "loss": 3.0, "ce": 3.0, "tokens_per_s": 10.0,
             "drop_rate": 0.0,
             "balance": [{"layer": layer, "expert_max_over_mean": value, "expert_cv": 0.1,
                          "dead_experts": 0, "dropped": 0}
                         for layer, value in enumerate(values)]}
            for step, values in ((1, (1.0, 3.0)), (2, (2.0, 4.0)))]


def _run_folder(path, rows, device="CPU"):
    path.mkdir(exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "config.yaml").write_text(yaml.safe_dump(
        {"context": {"mode": "GRAPH_MODE", "device_target": device, "seed": 1}}))
    return str(path)


def test_balance_percentiles_run_over_every_logged_step_and_layer():
    got = balance_percentiles(_ep_rows(), "device_max_over_mean")
    assert got["p50"] == pytest.approx(1.3) and got["p95"] == pytest.approx(1.75)
    assert got["max"] == pytest.approx(1.8)
    assert got["layer_steps"] == 6 and got["steps"] == 3
    assert balance_percentiles(_ep_rows(), "copies") is None


def test_the_device_load_matrix_sums_layers_per_device_and_step():
    load, steps, replans = device_load_matrix(_ep_rows())
    np.testing.assert_array_equal(load, [[11, 15, 13], [9, 5, 7]])      # [device, step]
    assert steps.tolist() == [1, 2, 3] and replans == [2]
    per_layer, _, _ = device_load_matrix(_ep_rows(), per_layer=True)
    assert per_layer.shape == (2, 2, 3)
    np.testing.assert_array_equal(per_layer[1], [[5, 7, 9], [5, 3, 1]])
    # a resume at another world size: the missing device is NaN, not 0
    rows = _ep_rows()
    rows[1]["balance"][0]["rows_per_device"] = [6, 4, 2]
    load, _, _ = device_load_matrix(rows)
    assert load[2, 0] == 2 and np.isnan(load[2, 1:]).all()


def test_a_bad_rows_per_device_is_named():
    rows = _ep_rows()
    rows[1]["balance"][1]["rows_per_device"] = [5, -1]
    with pytest.raises(ValueError, match=r"step 1, MoE layer 1: 'rows_per_device' must be "
                                         r">= 0, but got -1 for device 1"):
        device_load_matrix(rows)


def test_the_expert_parallel_report(tmp_path):
    run = _run_folder(tmp_path / "ep", _ep_rows(), device="Ascend")
    text = open(write_report(run, summaries=False)).read()
    assert ("All figures are **measured** with MindSpore on Ascend in GRAPH_MODE, "
            "2 expert-parallel ranks") in text
    assert "this machine" not in text
    assert "3, steps 1 to 3" in text and "6 layer-steps" in text
    assert "| rows per device, max / mean | 1.3 | 1.75 | 1.8 | 6 |" in text
    assert "(after steps 2)" in text and "![device load](device_load.png)" in text
    assert (tmp_path / "ep" / "device_load.png").stat().st_size > 0
    assert not (tmp_path / "ep" / "summary").exists()


def test_the_one_process_report_says_why_there_is_no_device_map(tmp_path):
    rows = _one_process_rows()
    assert "one-process run" in device_load_missing_reason(rows)
    with pytest.raises(ValueError, match="no per-device load: this is a one-process run"):
        device_load_matrix(rows)
    run = _run_folder(tmp_path / "one", rows)
    (tmp_path / "one" / "device_load.png").write_bytes(b"stale")     # an earlier build's
    text = open(write_report(run, summaries=False)).read()
    assert "MindSpore on CPU in GRAPH_MODE, one process" in text
    assert "No per-device load map: this is a one-process run" in text
    assert not (tmp_path / "one" / "device_load.png").exists()
    # 1, 3, 2, 4 over 4 layer-steps: p50 2.5, p95 3.85
    assert "| tokens per expert, max / mean | 2.5 | 3.85 | 4 | 4 |" in text


def test_the_device_comes_from_the_run_config(tmp_path):
    assert run_device(_run_folder(tmp_path / "a", [], device="GPU")) == ("GPU", "GRAPH_MODE")
    assert run_device(str(tmp_path / "none")) == (None, None)     # no config.yaml
    with pytest.raises(ValueError, match=r"'context.device_target' must be one of "
                                         r"\['CPU', 'Ascend', 'GPU'\], but got 'TPU'"):
        run_device(_run_folder(tmp_path / "b", [], device="TPU"))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "metrics.jsonl").write_text(json.dumps(_ep_rows()[1]) + "\n")
    text = open(write_report(str(tmp_path / "c"), summaries=False)).read()
    assert "the device is not recorded (the run folder has no config.yaml" in text


def test_summary_scalars_per_step():
    scalars = summary_scalars(_ep_rows())
    assert list(scalars) == [0, 1, 2, 3]
    assert scalars[0] == {"val_loss": 5.5}
    assert scalars[2]["loss"] == 3.0 and scalars[2]["drop_rate"] == 0.02
    assert scalars[2]["balance/device_max_over_mean/p50"] == pytest.approx(1.5)
    assert scalars[2]["balance/device_max_over_mean/p95"] == pytest.approx(1.59)
    assert scalars[3]["val_loss"] == 2.5 and scalars[3]["tokens_per_s"] == 300.0


def _read_events(folder):
    """{step: {tag: value}} of the one events file in ``folder``."""
    from mindspore.train.summary_pb2 import Event

    (name,) = os.listdir(folder)
    data, at, out = open(os.path.join(folder, name), "rb").read(), 0, {}
    while at < len(data):
        (size,) = struct.unpack("<Q", data[at:at + 8])
        event = Event()
        event.ParseFromString(data[at + 12:at + 12 + size])
        at += 16 + size
        if event.HasField("summary"):
            out[event.step] = {v.tag: v.scalar_value for v in event.summary.value}
    return out


def test_summaries_are_written_through_summary_record_once_per_build(tmp_path):
    run = _run_folder(tmp_path / "ep", _ep_rows())
    for _ in range(2):                     # a rebuild replaces the folder: no duplicates
        text = open(write_report(run)).read()
        assert "are in `summary/`, written through MindSpore's SummaryRecord" in text
        events = _read_events(os.path.join(run, "summary"))
        assert sorted(events) == [0, 1, 2, 3]
        assert events[1]["loss"] == pytest.approx(4.0)
        assert events[3]["val_loss"] == pytest.approx(2.5)
        assert events[2]["balance/device_max_over_mean/p95"] == pytest.approx(1.59)
    assert not [n for n in os.listdir(run) if n.startswith(".tmp-")]


def test_a_summary_failure_is_named_not_fatal(tmp_path, monkeypatch):
    import mindspore.train.summary as summary

    def refuse(*args, **kwargs):
        raise RuntimeError("only one instance is supported in a training process")

    monkeypatch.setattr(summary, "SummaryRecord", refuse)
    run = _run_folder(tmp_path / "ep", _ep_rows())
    text = open(write_report(run)).read()
    assert ("Not written: RuntimeError: only one instance is supported in a training "
            "process") in text
    assert not os.path.exists(os.path.join(run, "summary"))
    assert not [n for n in os.listdir(run) if n.startswith(".tmp-")]
    assert report.SUMMARY_DIR == "summary"
