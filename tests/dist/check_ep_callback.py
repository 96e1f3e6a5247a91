"""msrun worker for tests/test_ep_train.py: ``Model.train`` on 2 CPU ranks of a network holding
a grouped ``ExpertParallelMoE``, with ``EfficientMoECallback`` re-placing its experts.

Run on every rank by tests/dist/run_checks.py (alone: ``python check_ep_callback.py OUT_DIR``,
results in OUT_DIR/check_ep_callback). The train cell reduces
gradients as ``train.expert_parallel.GradReducer`` does (router averaged over ranks, experts
divided by W); EfficientMoE checks every 3 steps and forces a re-plan at step FORCE_AT. Writes
``callback_rank<r>.json`` in its folder: the callback's re-plan records, the losses, and, after
training, the local slots' experts and weights, and at every step's end, before and after the
callback, every local slot's expert and optimizer state (Adam's moments), so the test can
check that a re-plan gives every slot the moments its expert had.
"""
import json
import os
import sys

import numpy as np

E, H, F, K = 4, 16, 32, 2
B, S = 2, 8                       # per rank
STEPS, FORCE_AT = 10, 4


def check(out_dir, rank, world):
    """Model.train on this rank (run_checks.py has called init())."""
    import mindspore as ms
    import mindspore.dataset as ds
    from mindspore import nn
    from mindspore.train import Model

    from ms_efficient.core.config import EfficientMoEConfig
    from ms_efficient.efficientmoe.apply import EfficientMoECallback
    from ms_efficient.moe.ep_layer import ExpertParallelMoE
    from ms_efficient.efficientmoe.ep_replanner import dropless_plans
    from ms_efficient.moe.ep_replan import weight_states
    from ms_efficient.train.optim import GradReducer

    import logging

    logging.basicConfig(level=logging.DEBUG if os.environ.get("EP_DEBUG") else logging.INFO)
    (plan,) = dropless_plans(1, E, world, K, world * B * S)
    layer = ExpertParallelMoE(H, F, E, K, plan, slots_per_device=E // world + 1, seed=3)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.moe = layer

        def construct(self, x, target):
            y, aux, _, _ = self.moe(x)
            return ((y - target) ** 2).mean() + 0.01 * aux

    class TrainStep(nn.Cell):
        def __init__(self, net, optimizer):
            super().__init__()
            self.net, self.optimizer = net, optimizer
            self.grad_fn = ms.value_and_grad(net, None, optimizer.parameters)
            self.reducer = GradReducer(optimizer.parameters, [layer], world, 0.0)

        def construct(self, x, target):
            loss, grads = self.grad_fn(x, target)
            self.optimizer(self.reducer(grads))
            return loss

    net = Net()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=1e-2)
    rng = np.random.default_rng(rank)
    data = [(rng.standard_normal((B, S, H)).astype(np.float32),
             rng.standard_normal((B, S, H)).astype(np.float32)) for _ in range(STEPS)]
    dataset = ds.GeneratorDataset(data, ["x", "target"], shuffle=False)
    em = EfficientMoEConfig(enabled=True, warmup_steps=3, replan_every=3, window=3,
                            force_replan_step=FORCE_AT)
    callback = EfficientMoECallback(net, em)
    losses, moments = [], {"before": [], "after": []}
    # Adam's moment tables of w1, b1, w2, b2, kind-major
    state = sum(weight_states(optimizer, (layer.w1, layer.b1, layer.w2, layer.b2)), ())

    class LossLog(ms.train.Callback):
        def on_train_step_end(self, run_context):
            losses.append(float(run_context.original_args().net_outputs.asnumpy()))

    class MomentLog(ms.train.Callback):
        """Local experts and the optimizer state of their slots, at every step's end."""

        def __init__(self, key):
            super().__init__()
            self.key = key

        def on_train_step_end(self, run_context):
            local = [int(e) for e in layer.local_experts]
            moments[self.key].append({"experts": local, "state": [
                p.asnumpy()[:len(local)].reshape(len(local), -1).tolist() for p in state]})

    Model(TrainStep(net, optimizer)).train(
        1, dataset, callbacks=[MomentLog("before"), callback, MomentLog("after"), LossLog()],
        dataset_sink_mode=False)
    local = [int(e) for e in layer.local_experts]
    result = {"rank": rank, "plans": callback.plans, "losses": losses,
              "local_experts": local, "moments": moments, "state_names": [p.name for p in state],
              "w1": layer.w1.asnumpy()[:len(local)].tolist(),
              "plan": layer.plan.to_dict()}
    with open(os.path.join(out_dir, f"callback_rank{rank}.json"), "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import run_checks

    run_checks.main(sys.argv[1], ["check_ep_callback"])
