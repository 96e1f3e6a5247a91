"""ms_efficient: faster, leaner training of dense and Mixture-of-Experts models in MindSpore.

``import ms_efficient`` is cheap: planners (cluster model, simulator, graph tools, traces) are
plain numpy; MindSpore is imported only by the modules that build or change networks.

    import ms_efficient
    network, plans = ms_efficient.optimize(network, "configs/gpt_moe_tiny.yaml")
"""
from ms_efficient.passes import optimize, register_pass, registered_passes

__version__ = "0.1.0"

__all__ = ["optimize", "register_pass", "registered_passes", "__version__"]
