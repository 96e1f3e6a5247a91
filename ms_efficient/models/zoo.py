"""Graphs of real MindSpore networks for the planners' benchmarks, exported to MINDIR on this
machine (``from_network``) and cached as OpGraph JSON. MindSpore (and mindcv) are imported
only when a graph is built.

- ``reference_model_graph``: the repository's GPT-MoE reference model for a config YAML.
- ``dense_reference_graph``: the same network with dense FFNs only, as the shard templates
  model it (fused GeLU, dropout), for comparing the graph-driven and the template ILP.
- ``mindcv_graph``: a mindcv vision model (``pip install mindcv==0.3.0``, in
  requirements.txt; ``None`` when it is missing), e.g. resnet50 at 224 px, inception_v3 at
  299 px. Exports take 3-13 s on the 2-core machine, a cached graph loads in milliseconds.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

from ms_efficient.graph.opgraph import OpGraph

__all__ = ["reference_model_graph", "dense_reference_graph", "mindcv_graph", "MINDCV_IMAGE_SIZE"]

logger = logging.getLogger(__name__)

# Input side (pixels) each mindcv model was designed for (its paper's input resolution).
MINDCV_IMAGE_SIZE = {"inception_v3": 299}


def _cached(cache: Optional[str], newer_than: Optional[str] = None) -> Optional[OpGraph]:
    if not cache or not os.path.isfile(cache):
        return None
    if newer_than and os.path.getmtime(cache) < os.path.getmtime(newer_than):
        return None
    return OpGraph.load_json(cache)


def _store(graph: OpGraph, cache: Optional[str]) -> OpGraph:
    if cache:
        os.makedirs(os.path.dirname(cache) or ".", exist_ok=True)
        graph.save_json(cache)
    return graph


def reference_model_graph(config_path: str, cache_dir: Optional[str] = None) -> OpGraph:
    """Forward OpGraph of the reference GPT-MoE for a config YAML (MINDIR export, imports
    MindSpore); cached as ``<cache_dir>/<config name>.forward.json`` when ``cache_dir`` is
    given (rebuilt when the config is newer)."""
    stem = os.path.splitext(os.path.basename(config_path))[0]
    cache = os.path.join(cache_dir, f"{stem}.forward.json") if cache_dir else None
    graph = _cached(cache, newer_than=config_path)
    if graph is not None:
        return graph
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor

    from ms_efficient.core import backend
    from ms_efficient.core.config import load_config
    from ms_efficient.graph import from_network
    from ms_efficient.models.gpt_moe import build_model

    cfg = load_config(config_path)
    ms.set_context(mode=ms.GRAPH_MODE)
    backend.use_device(cfg.context.device_target)
    ms.set_seed(cfg.context.seed)
    net = build_model(cfg.model, cfg.moe, cfg.train.batch_size)
    tokens = Tensor(np.zeros((cfg.train.batch_size, cfg.model.seq_length), np.int32))
    graph = from_network(net, tokens, tokens, mode="forward")
    graph.name = stem
    return _store(graph, cache)


def dense_reference_graph(num_layers: int, hidden: int, heads: int, seq: int, batch: int,
                          vocab: int, ffn: int) -> OpGraph:
    """Forward OpGraph of the reference GPT with dense FFNs in every block, the Ascend GeLU
    (``nn.GELU(approximate=True)``, one op, not the CPU composite) and dropout 0.1: the network
    ``shard.workloads.transformer_ops`` describes by hand (imports MindSpore)."""
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn

    from ms_efficient.core.config import config_from_dict
    from ms_efficient.graph import from_network
    from ms_efficient.models.gpt_moe import build_model

    cfg = config_from_dict({
        "model": {"num_layers": num_layers, "hidden_size": hidden, "num_heads": heads,
                  "seq_length": seq, "vocab_size": vocab, "ffn_hidden_size": ffn,
                  "dropout": 0.1},
        "moe": {"num_experts": 2, "top_k": 1, "moe_every": num_layers + 1},
        "train": {"batch_size": batch}})
    ms.set_context(mode=ms.GRAPH_MODE)
    net = build_model(cfg.model, cfg.moe, batch)
    for block in net.blocks:
        block.ffn.gelu = nn.GELU(approximate=True)
    tokens = Tensor(np.zeros((batch, seq), np.int32))
    graph = from_network(net, tokens, tokens, mode="forward")
    graph.name = f"gpt-dense-L{num_layers}-h{hidden}"
    return graph


def mindcv_graph(model_name: str, image_size: Optional[int] = None, batch: int = 1,
                 cache_dir: Optional[str] = None) -> Optional[OpGraph]:
    """Forward OpGraph of mindcv's ``model_name`` for ``batch`` images of ``image_size``
    pixels (default: ``MINDCV_IMAGE_SIZE`` or 224), or None (logged) when mindcv is not
    installed. Cached as ``<cache_dir>/<model>-<size>px-b<batch>.forward.json``."""
    size = image_size or MINDCV_IMAGE_SIZE.get(model_name, 224)
    if batch < 1 or size < 32:
        raise ValueError(f"'batch' must be >= 1 and 'image_size' >= 32, but got {batch} and "
                         f"{size}.")
    cache = (os.path.join(cache_dir, f"{model_name}-{size}px-b{batch}.forward.json")
             if cache_dir else None)
    graph = _cached(cache)
    if graph is not None:
        return graph
    try:
        import mindcv  # noqa: F401  (in requirements.txt; optional for the library)
    except ImportError:
        logger.info("mindcv is not installed: skipping workload %s (pip install mindcv==0.3.0)",
                    model_name)
        return None
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor

    from ms_efficient.graph import from_network

    if model_name not in mindcv.list_models():
        raise ValueError(f"mindcv has no model {model_name!r}; see mindcv.list_models().")
    ms.set_context(mode=ms.GRAPH_MODE)
    net = mindcv.create_model(model_name, pretrained=False)
    net.set_train(False)
    x = Tensor(np.zeros((batch, 3, size, size), np.float32))
    graph = from_network(net, x, mode="forward")
    graph.name = model_name
    graph.meta.update({"source": "mindir", "model": f"mindcv/{model_name}",
                       "image_size": size, "batch": batch})
    return _store(graph, cache)
