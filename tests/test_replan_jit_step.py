"""Re-plans between the steps of an ``ms.jit`` train step (the expert-parallel trainer's kind):
the rows, moments, plan tables and gradient weights a re-plan writes must reach the compiled
step (ms_efficient.core.params.write_parameter), not only the host copies ``set_data`` would
replace. One process, W = 1, GRAPH_MODE; about 10 s."""
import numpy as np
import pytest

import mindspore as ms
from mindspore import Parameter, Tensor, nn

from ms_efficient.core.params import write_parameter
from ms_efficient.moe.ep_layer import ExpertParallelMoE
from ms_efficient.train.optim import GradReducer
from tests.test_ep_migration import E, F, H, K, PLAN_FROM, PLAN_TO, Loss, batch, state, weights

ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")


class Scale(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(Tensor(np.ones((2, 3), np.float32)), name="w")

    def construct(self, x):
        return (self.w * x).sum()


def jit_train_step(net, optimizer):
    """``step(*inputs) -> loss``: a jit function closing over ``net`` and ``optimizer``, as
    ExpertParallelTrainer._build_steps builds it."""
    grad_fn = ms.value_and_grad(net, None, optimizer.parameters)

    @ms.jit
    def step(*inputs):
        loss, grads = grad_fn(*inputs)
        optimizer(grads)
        return loss

    return step


def scale_after_write(write):
    """Loss of the third jit step after two Adam steps and ``write(w, 0.5)`` in between."""
    net = Scale()
    step = jit_train_step(net, nn.AdamWeightDecay(net.trainable_params(), learning_rate=0.1))
    x = Tensor(np.ones((2, 3), np.float32))
    step(x)
    step(x)
    write(net.w, np.full((2, 3), 0.5, np.float32))
    return float(step(x).asnumpy())


def test_write_parameter_reaches_a_jit_step_that_already_ran_and_set_data_does_not():
    assert scale_after_write(write_parameter) == pytest.approx(3.0)     # sum(0.5 * ones(2, 3))
    # the MindSpore 2.10 behaviour write_parameter exists for: the step keeps its own values
    assert scale_after_write(lambda p, v: p.set_data(Tensor(v))) != pytest.approx(3.0, abs=0.1)
    with pytest.raises(ValueError, match=r"'w' must have its shape \(2, 3\), but got \(3,\)"):
        write_parameter(Scale().w, np.zeros(3))


def test_set_plan_between_jit_steps_trains_the_moved_rows_like_a_layer_that_stayed():
    """Two layers from the same weights take a jit Adam step; one switches PLAN_FROM ->
    PLAN_TO (every slot permuted, expert 0 replicated) with its moments; both take a second
    step. The moved layer's rows and moments, read back per expert, equal the other's (up to
    the replica's split of expert 0's rows): the second step trained what set_plan wrote.
    With set_data the step kept training its old rows and these stayed at the moved values."""
    w = weights()
    layers, steps, adams = [], [], []
    for _ in range(2):
        layer = ExpertParallelMoE(H, F, E, K, PLAN_FROM, slots_per_device=5)
        layer.set_weights(*w)
        adam = nn.Adam(layer.trainable_params(), learning_rate=1e-2)
        layers.append(layer)
        adams.append(adam)
        steps.append(jit_train_step(Loss(layer), adam))
    for step in steps:
        step(*batch(0))
    moved, kept = layers
    moved.set_plan(PLAN_TO, optimizer=adams[0])
    at_move = state(moved, adams[0])
    losses = [float(step(*batch(1)).asnumpy()) for step in steps]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    got, ref = state(moved, adams[0]), state(kept, adams[1])
    rows = PLAN_TO.slot_expert.tolist()                 # row i of the moved layer: expert
    for name in got:
        expert = name.rsplit(".", 1)[-1] in ("w1", "b1", "w2", "b2")
        want = ref[name][rows] if expert else ref[name]
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
    assert np.abs(got["layer.w1"] - at_move["layer.w1"]).max() > 1e-3    # the step moved them


def test_grad_reducer_slot_weights_reach_a_jit_step_after_a_replan():
    """Clipping to a tiny norm returns grad x clip / norm, so the norm the jit step used is
    clip / output. Gradients of ones, expert rows scaled by (row + 1): norm^2 = router size
    + sum_i weight_i (i + 1)^2 x row size, weight_i = 1 / replicas of row i's expert (0 for
    an empty row): PLAN_FROM [1, 1, 1, 1, 0] -> 30 rows' worth, PLAN_TO [3, 0, 2, 1, 0] ->
    [1, .5, 1, 1, .5] -> 40.5."""
    layer = ExpertParallelMoE(H, F, E, K, PLAN_FROM, slots_per_device=5)
    adam = nn.Adam(layer.trainable_params(), learning_rate=1e-2)
    clip = 1e-6
    reducer = GradReducer(adam.parameters, [layer], world=1, clip=clip)
    experts = {id(p) for p in (layer.w1, layer.b1, layer.w2, layer.b2)}

    def ones(p):
        g = np.ones(p.shape, np.float32)
        if id(p) in experts:                                 # row i scaled by i + 1
            g *= np.arange(1, 6, dtype=np.float32).reshape((5,) + (1,) * (g.ndim - 1))
        return Tensor(g)

    grads = tuple(ones(p) for p in adam.parameters)
    router = int(np.prod(layer.router.weight.shape))
    row = H * F + F + F * H + H

    dense = [i for i, p in enumerate(adam.parameters) if id(p) not in experts]
    assert len(dense) == 1                                   # the router's weight

    @ms.jit
    def used_norm(grads):
        return clip / reducer(grads)[dense[0]].reshape(-1)[0]

    assert float(used_norm(grads).asnumpy()) == pytest.approx(np.sqrt(router + 30 * row),
                                                              rel=1e-5)
    layer.set_plan(PLAN_TO, optimizer=adam)
    reducer.set_plans([layer])
    assert float(used_norm(grads).asnumpy()) == pytest.approx(np.sqrt(router + 40.5 * row),
                                                              rel=1e-5)
