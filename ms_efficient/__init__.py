"""ms_efficient: faster, leaner training of dense and Mixture-of-Experts models in MindSpore.

    import ms_efficient
    cfg = ms_efficient.load_config("my_run.yaml")      # or config_from_dict({...})
    network, plans = ms_efficient.optimize(network, cfg, sample_inputs=(ids, labels))
    # a pass that finds nothing worth changing is plans[name] == {"refused": reason};
    # strict=True raises it (ms_efficient.PassRefused) instead
    parallel_net = ms_efficient.parallelize(network, plans, (ids, labels))   # on Ascend

``import ms_efficient`` is cheap: planners (cluster model, simulator, graph tools, traces) are
plain numpy; MindSpore is imported only by the modules that build or change networks.

Package map (each capability is one folder with the same role files: ``planner`` (the entry
point, pure numpy), ``baselines`` (what it is compared with, written from their papers),
``apply`` / ``layer`` (the MindSpore-facing part: passes, Cells, callbacks), ``bench`` (the benchmark
rows) and ``commands`` (its ``ms-efficient plan|bench`` sub-commands)):

    core/          config, cluster model, collectives, pass registry, backend, file writes
    graph/         OpGraph and its readers (MINDIR, PipeDream, JSON), FLOP/byte estimates
    sim/           the event-driven simulator every planner scores its plans with
    moe/           MoE runtime: layer Cells, expert-parallel layer, All-to-All, dispatch
                   kernels, the ExpertPlan and routing-trace formats
    models/        the reference GPT-MoE network and the exported benchmark graphs (zoo)
    efficientmoe/  the two levels: slow-level layout and its re-plans, the balanced step's
                   cost, the replay of ours and every baseline; static capacities from a trace
    mpipe/         chunked All-to-All / expert-compute overlap and activation reuse
    memopt/        dual-agent RL keep/recompute/swap planner and its MILP baselines
    shard/         minimal-redundancy sharding ILP and the Megatron / ZeRO baselines
    place/         TGA partitioning and placement and the Baechi / Hierarchical baselines
    train/         trainer, corpus and run report of the reference model; TrainOneStepCell
                   for networks with expert-parallel MoE layers
    adopt/         adopt_moe(): a user's own MoE blocks replaced by the package's layer
                   (expert-parallel too: adopt_moe(..., expert_parallel=True),
                   save_moe_checkpoint, load_moe_optimizer_state)
    parallel/      parallelize(): the plans as MindSpore's AutoParallel; the launch bundle
    verify/        the compile-time check of the plans (optimize(..., verify=True))
    passes.py      optimize(): runs the configured passes on a network
    cli.py         the ``ms-efficient`` command

Layers, lowest first; a module imports only from its own layer or below (tests/test_layout.py
checks this and that there is no import cycle): core -> graph, sim -> moe -> models ->
the capabilities -> train -> passes, cli. Planners never import MindSpore.
"""
from ms_efficient.core.config import config_from_dict, load_config
from ms_efficient.parallel import parallelize
from ms_efficient.passes import PassRefused, optimize, register_pass, registered_passes

__version__ = "0.1.0"



def adopt_moe(network, tokens, **kwargs):
    """Replace ``network``'s own MoE blocks by the package's layer (``ms_efficient.adopt.
    replace.adopt_moe``: arguments, block contract and return value there)."""
    from ms_efficient.adopt.replace import adopt_moe as adopt

    return adopt(network, tokens, **kwargs)


def __getattr__(name):
    """``ms_efficient.TrainOneStepCell`` (``ms_efficient.train.optim``),
    ``ms_efficient.save_moe_checkpoint`` and ``load_moe_optimizer_state``
    (``ms_efficient.adopt.parallel``) and
    ``ms_efficient.EfficientMoECallback`` (``ms_efficient.efficientmoe.apply``), imported on
    first use so that ``import ms_efficient`` stays free of MindSpore."""
    if name == "EfficientMoECallback":
        from ms_efficient.efficientmoe.apply import EfficientMoECallback

        return EfficientMoECallback
    if name == "TrainOneStepCell":
        from ms_efficient.train.optim import TrainOneStepCell

        return TrainOneStepCell
    if name in ("save_moe_checkpoint", "load_moe_optimizer_state"):
        from ms_efficient.adopt import parallel

        return getattr(parallel, name)
    raise AttributeError(f"module 'ms_efficient' has no attribute {name!r}")


__all__ = ["optimize", "parallelize", "adopt_moe", "TrainOneStepCell", "save_moe_checkpoint",
           "load_moe_optimizer_state", "EfficientMoECallback",
           "load_config", "config_from_dict", "register_pass", "registered_passes",
           "PassRefused", "__version__"]
