"""Counter-based dropout (ms_efficient/models/dropout.py): the mask is a function of (seed, step,
block, site, global sample, position, channel), the Cell computes the numpy reference's bits,
a rank's rows see the one-process mask's rows, and a one-process run with dropout resumed
half-way ends bit for bit where the unbroken run does.

The msrun chain (2 -> 4 -> 1 -> 2 workers with dropout) is in tests/test_ep_resize.py.
"""
import json
import os

import numpy as np
import pytest
import yaml

from conftest import tiny_config_dict
from ms_efficient.models.dropout import (StepDropout, dropout_key, keep_mask_reference,
                                         keep_threshold)

P = 0.25
SHAPE = (4, 16, 32)                     # [B, S, H]


# --- the hash (numpy) -------------------------------------------------------------------------


def test_reference_mask_is_a_pure_function_of_its_counters():
    a = keep_mask_reference(P, 7, 1, 0, 5, 0, SHAPE)
    assert a.shape == SHAPE and a.dtype == bool
    np.testing.assert_array_equal(a, keep_mask_reference(P, 7, 1, 0, 5, 0, SHAPE))
    # every counter changes the mask: step, block, site, seed, sample offset
    for other in [(7, 1, 0, 6, 0), (7, 2, 0, 5, 0), (7, 1, 1, 5, 0), (8, 1, 0, 5, 0),
                  (7, 1, 0, 5, 4)]:
        b = keep_mask_reference(P, *other, SHAPE)
        agree = float((a == b).mean())
        # independent masks agree on (1-p)^2 + p^2 = 0.625 of the elements
        assert abs(agree - 0.625) < 0.03, (other, agree)
    assert keep_mask_reference(0.0, 7, 1, 0, 5, 0, SHAPE).all()


def test_a_ranks_rows_are_the_one_process_rows_of_its_global_samples():
    full = keep_mask_reference(P, 3, 0, 1, 9, 0, SHAPE)
    b = SHAPE[0]
    for world in (2, 4):
        local = b // world
        for rank in range(world):
            part = keep_mask_reference(P, 3, 0, 1, 9, rank * local, (local,) + SHAPE[1:])
            np.testing.assert_array_equal(part, full[rank * local:(rank + 1) * local])


def test_threshold_and_key_are_exact_integers():
    assert keep_threshold(0.0) == 0
    assert keep_threshold(0.5) == 1 << 23
    assert keep_threshold(0.1) == 1677722            # ceil(0.1 * 2**24)
    key = dropout_key(-1, 3, 1)                       # any seed: its low 31 bits
    assert 0 <= key < 2 ** 31 and key == dropout_key(2 ** 31 - 1, 3, 1)


@pytest.mark.parametrize("kwargs, message", [
    ({"p": 1.5}, "StepDropout 'p' must be in [0, 1), but got 1.5."),
    ({"p": 1.0}, "StepDropout 'p' must be in [0, 1), but got 1.0."),
    ({"p": 0.1, "block": -1}, "StepDropout 'block' must be an integer >= 0, but got -1."),
    ({"p": 0.1, "sample_offset": 2.0},
     "StepDropout 'sample_offset' must be an integer >= 0, but got 2.0."),
    ({"p": 0.1, "seed": "7"}, "StepDropout 'seed' must be an integer, but got '7'."),
])
def test_bad_arguments_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError) as err:
        StepDropout(**kwargs)
    assert str(err.value) == message


# --- the Cell (MindSpore, GRAPH_MODE) ---------------------------------------------------------


def _apply(cell, x, step):
    from mindspore import Tensor

    from ms_efficient.models.dropout import set_dropout_step

    set_dropout_step([cell], step)
    return cell(Tensor(x)).asnumpy()


@pytest.mark.mindspore
def test_cell_mask_is_the_reference_bit_for_bit(graph_mode):
    cell = StepDropout(P, seed=7, block=1, site=1, sample_offset=3)
    x = np.arange(2 * 3 * 5, dtype=np.float32).reshape(2, 3, 5) + 1
    for step in (5, 6):
        y = _apply(cell, x, step)
        keep = keep_mask_reference(P, 7, 1, 1, step, 3, x.shape)
        assert 0 < keep.sum() < keep.size
        # kept: x / (1 - p) (one float32 multiply by the scale), dropped: 0
        scale = np.where(keep, np.float32(1 / (1 - P)), np.float32(0))
        np.testing.assert_array_equal(y, x * scale)
    assert int(cell.dropout_step.asnumpy()) == 6


@pytest.mark.mindspore
def test_kept_fraction_is_one_minus_p_and_a_rank_sees_its_rows_of_the_mask(graph_mode):
    p, shape = 0.1, (8, 64, 128)
    full = _apply(StepDropout(p, seed=11, block=2), np.ones(shape, np.float32), 40) != 0
    np.testing.assert_array_equal(full, keep_mask_reference(p, 11, 2, 0, 40, 0, shape))
    n = full.size
    # binomial(n, 1 - p): within 5 standard deviations
    assert abs(full.sum() - n * (1 - p)) <= 5 * np.sqrt(n * p * (1 - p)), full.mean()
    # rank 1 of 2: offset B / 2, the second half of the rows
    half = shape[0] // 2
    rank1 = StepDropout(p, seed=11, block=2, sample_offset=half)
    part = _apply(rank1, np.ones((half,) + shape[1:], np.float32), 40) != 0
    np.testing.assert_array_equal(part, full[half:])


@pytest.mark.mindspore
def test_p_zero_and_eval_mode_are_the_identity(graph_mode):
    from mindspore import Tensor

    from ms_efficient.models.dropout import set_dropout_step

    x = np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float32)
    np.testing.assert_array_equal(_apply(StepDropout(0.0), x, 3), x)
    cell = StepDropout(0.5, seed=1)
    assert not cell.training                          # a Cell's default: eval
    assert not np.array_equal(_apply(cell, x, 3), x)  # training: dropped
    assert cell.training
    set_dropout_step([cell], None)
    assert not cell.training
    np.testing.assert_array_equal(cell(Tensor(x)).asnumpy(), x)


@pytest.mark.mindspore
def test_the_model_has_two_dropout_sites_per_block_only_with_dropout(graph_mode):
    from ms_efficient.core.config import ModelConfig, MoEConfig
    from ms_efficient.models.dropout import dropout_cells
    from ms_efficient.models.gpt_moe import build_model

    model = ModelConfig(seq_length=8, hidden_size=16, num_layers=2, num_heads=2,
                        ffn_hidden_size=32, dropout=0.1)
    moe = MoEConfig(num_experts=2, top_k=1)
    net = build_model(model, moe, 4, dropout_seed=5, sample_offset=2)
    cells = dropout_cells(net)
    assert [(c.block, c.site, c.seed, c.sample_offset) for c in cells] == [
        (0, 0, 5, 2), (0, 1, 5, 2), (1, 0, 5, 2), (1, 1, 5, 2)]
    names = [p.name for p in net.get_parameters() if p.name.endswith("dropout_step")]
    assert names == ["blocks.0.dropout.dropout_step", "blocks.0.ffn_dropout.dropout_step",
                     "blocks.1.dropout.dropout_step", "blocks.1.ffn_dropout.dropout_step"]
    assert all(not p.requires_grad for p in net.get_parameters() if p.name in names)
    model.dropout = 0.0
    assert dropout_cells(build_model(model, moe, 4)) == []


# --- one process: resumed half-way = unbroken ----------------------------------------------


class _Killed(Exception):
    pass


def _losses(run_dir, kind="train", key="loss"):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return {r["step"]: r[key] for r in map(json.loads, fh) if r["kind"] == kind}


@pytest.mark.mindspore
def test_one_process_run_with_dropout_resumed_half_way_ends_where_the_unbroken_one_does(
        tmp_path, text_dir, monkeypatch):
    """Dropout 0.1, 6 steps: unbroken, and killed after step 3's checkpoint (an exception
    out of ``save``) then resumed to 6: the same losses per step, routing trace, and final
    parameters and Adam moments, bit for bit (the one-process resume test: a state restored
    wrongly shows here). The train step does apply dropout (its
    cross-entropy at step 1 is not the eval step's on the same batch) and evaluation does not."""
    import mindspore as ms
    from mindspore import Tensor

    from ms_efficient.core.config import load_config
    from ms_efficient.models.dropout import set_dropout_step
    from ms_efficient.train.trainer import Trainer

    cfg_dict = tiny_config_dict(text_dir, str(tmp_path / "unused"))
    cfg_dict["model"]["dropout"] = 0.1
    cfg_dict["train"].update(steps=6, save_every=3, eval_every=3, log_every=1)
    path = tmp_path / "dropout.yaml"
    path.write_text(yaml.safe_dump(cfg_dict))
    cfg = load_config(str(path))

    full = Trainer(cfg, str(tmp_path / "full"))
    assert len(full.dropouts) == 2 * cfg.model.num_layers
    x0, y0 = full.corpus.train_batch(0, cfg.train.batch_size, cfg.model.seq_length,
                                     cfg.context.seed)
    set_dropout_step(full.dropouts, None)
    ce_no_dropout = float(full.eval_step(Tensor(x0), Tensor(y0)).asnumpy())
    full.run()
    ce_step1 = _losses(full.out_dir, key="ce")[1]
    assert abs(ce_step1 - ce_no_dropout) > 1e-3, (ce_step1, ce_no_dropout)
    assert full.evaluate() == full.evaluate()             # eval: no mask, deterministic

    part_dir = str(tmp_path / "part")
    save = Trainer.save

    def save_then_die(self):
        save(self)
        if self.step == 3:
            raise _Killed

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "save", save_then_die)
        with pytest.raises(_Killed):
            Trainer(cfg, part_dir).run()
    assert json.loads(open(os.path.join(part_dir, "state.json")).read())["step"] == 3
    resumed = Trainer(cfg, part_dir, resume=True)
    resumed.run()
    a, b = _losses(full.out_dir), _losses(part_dir)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert a == b, (a, b)
    assert _losses(full.out_dir, "val", "val_loss") == _losses(part_dir, "val", "val_loss")
    assert sorted(_losses(part_dir, "val", "val_loss")) == [0, 3, 6]
    # the routing trace continues where the checkpoint left it: every step's counts equal
    from ms_efficient.moe.trace import load_trace

    traces = [load_trace(os.path.join(d, "trace.npz")).counts for d in (full.out_dir, part_dir)]
    assert traces[1].shape[0] == 6
    np.testing.assert_array_equal(traces[0], traces[1])
    final = {p.name: p.asnumpy() for p in full.optimizer.get_parameters()}
    for p in resumed.optimizer.get_parameters():
        np.testing.assert_array_equal(p.asnumpy(), final[p.name], err_msg=p.name)
    ckpt = ms.load_checkpoint(os.path.join(part_dir, "ckpt", "step_000006.ckpt"))
    # the mask's step is not state: the trainers write it before every step, so checkpoints
    # (of any world size) leave it out and nothing about dropout needs restoring
    assert "blocks.1.ffn_dropout.dropout_step" not in ckpt and "blocks.1.ffn.w1" in ckpt
