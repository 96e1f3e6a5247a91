"""The routers MoE users run: Switch/GShard, Mixtral, Qwen-MoE and DeepSeek-V2/V3 style top-k.

One configuration (:class:`RouterConfig`), a numpy reference written from the papers'
formulas (:func:`route_reference`, :func:`aux_loss_reference`, :func:`z_loss_reference`,
:func:`bias_update_reference`) and the MindSpore Cell a layer runs (:class:`Router`, with
:meth:`Router.aux_losses` and :func:`updated_bias`). :class:`Router` has the outputs of
:class:`ms_efficient.moe.layer.TopKArrival`, in its order, so a layer can swap it in; with the
default configuration it computes TopKArrival's results bit for bit.

Shapes (names carry their dimensions): T tokens (B sequences of S tokens, row t = b * S + s as
a layer flattens [B, S, H]), E experts, K = top_k, G = num_groups groups of M = E / G
experts, A = K * T assignments in k-major order (a = k * T + t: the first choices of all
tokens before the second choices, as in GShard).

The routing of one token, from its router logits x_E (float32):

    1. scores:     softmax: p_E = softmax(x_E) (over all E experts)
                   sigmoid: s_E = sigmoid(x_E) (each expert on its own; DeepSeek-V3)
    2. selection:  c_E = p_E ("softmax-topk"), x_E ("topk-softmax") or s_E (sigmoid),
                   plus the expert bias b_E when auxiliary-loss-free balancing is on
                   (selection only: the weights below never see b_E)
    3. groups:     with G > 1 and topk_groups < G, every group g gets a score from its c_e
                   (sum of its top-2, DeepSeek-V3; or its max, DeepSeek-V2); the experts of
                   all but the best topk_groups groups are masked (-inf)
    4. top-k:      expert_ids_K = the K largest masked c_e (``ops.topk``)
    5. weights:    softmax-topk: p_e; topk-softmax: softmax over the K chosen x_e;
                   sigmoid: s_e, of the chosen experts
    6. renormalize (optional): w_k / sum_k w_k;  7. times scaling_factor.

Ties. ``ops.topk`` on MindSpore 2.10's CPU does NOT break ties to the lower index when
K < E (checked: among equal values it may return higher indices first, e.g. an all-zero row
of 8 gives [6, 5] for K = 2; with K = E, and in the cases tried with K = E - 1, it does
return the lower index first). The Router uses ``ops.topk`` as TopKArrival does, so both
choose the same experts on ties; the numpy reference breaks ties to the lower expert id
(a stable sort). On exact ties the two may choose other experts of the same score, or
list tied chosen experts in another order (same weights, other ids); off ties they agree.

Papers: Switch Transformers (Fedus, Zoph, Shazeer; JMLR 2022, sec. 2.2: the load-balancing
loss); GShard (Lepikhin et al., ICLR 2021: top-2 gating, k-major arrival order); ST-MoE
(Zoph et al. 2022, sec. 3.3, eq. 5: the router z-loss); Mixtral of Experts (Jiang et al. 2024, sec.
2.1: softmax over the top-K logits); DeepSeek-V2 (DeepSeek-AI 2024, sec. 2.2.2:
device-limited routing, a group scored by its best expert); DeepSeek-V3 technical report
(DeepSeek-AI 2024, sec. 2.1.2: sigmoid gating with normalised weights, the routed scaling
factor (2.5 in its configuration), node-limited routing (a node's group scored by the sum
of its K / M highest scores: top-2 with K = 8 experts on at most M = 4 nodes),
auxiliary-loss-free balancing with a per-expert bias, and the complementary sequence-wise
balance loss).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

__all__ = ["RouterConfig", "Router", "updated_bias", "expert_bias_parameter",
           "router_scores_reference", "group_mask_reference", "route_reference",
           "aux_loss_reference", "z_loss_reference", "bias_update_reference",
           "SCORES", "ORDERS", "GROUP_SCORES", "AUX_LOSSES"]

logger = logging.getLogger(__name__)

SCORES = ("softmax", "sigmoid")
ORDERS = ("softmax-topk", "topk-softmax")
GROUP_SCORES = ("top2-sum", "max")
AUX_LOSSES = ("none", "switch", "sequence")
_FIELD = "moe.router."           # how the fields are named in errors (the YAML key path)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
    return (isinstance(value, (int, float, np.integer, np.floating))
            and not isinstance(value, (bool, np.bool_)) and math.isfinite(float(value)))


@dataclass(frozen=True)
class RouterConfig:
    """How a MoE layer turns router logits into top-k experts, weights and balancing losses.

    The names follow MindFormers' / DeepSeek-V3's configurations (their names in brackets).
    Fields that need E and K (the groups) are checked by :meth:`check`, which :class:`Router`
    and :func:`route_reference` call.

    Attributes:
        score: "softmax" (Switch, GShard, Mixtral, Qwen-MoE, DeepSeek-V2: one distribution
            over the E experts) or "sigmoid" (DeepSeek-V3 sec. 2.1.2: s_e = sigmoid(x_e), each
            expert scored on its own) [``scoring_func``].
        order: for softmax only: "softmax-topk" (softmax over all E, then the top-K of the
            probabilities, whose values are the weights: Switch, GShard, Mixtral's and
            Qwen-MoE's Hugging Face code) or "topk-softmax" (top-K of the logits, then a
            softmax over those K: Mixtral's reference code, Jiang et al. 2024 sec. 2.1; Megatron's
            ``moe_router_pre_softmax=False``). With renormalize both give the same weights
            up to rounding; without it they differ. A sigmoid router must keep the default.
        renormalize: divide the K chosen weights by their sum (Mixtral; DeepSeek-V3's
            sigmoid weights, sec. 2.1.2); False keeps them (Switch top-1,
            Qwen1.5-MoE ``norm_topk_prob=False``) [``norm_topk_prob``].
        scaling_factor: the routed scaling factor multiplying the final weights (1.0 = off;
            DeepSeek-V3 uses 2.5, DeepSeek-V2 16) [``routed_scaling_factor``]. > 0.
        num_groups: G, the experts split into G contiguous groups of E / G (expert e in group
            e // (E / G)) for group-limited routing (DeepSeek-V2 sec. 2.2.2 device-limited,
            DeepSeek-V3 sec. 2.1.2 node-limited); 1 = no group limit [``n_group``].
        topk_groups: how many groups a token may use: the best topk_groups by group score
            are kept, the other groups' experts masked before the top-K (1 <= topk_groups
            <= num_groups; topk_groups == num_groups = no limit) [``topk_group``].
        group_score: a group's score from its experts' selection scores: "top2-sum" (the sum
            of its two largest, DeepSeek-V3) or "max" (its largest, DeepSeek-V2).
        bias_update_speed: gamma of DeepSeek-V3's auxiliary-loss-free balancing (sec.
            2.1.2): a per-expert bias b_e is added to the selection scores (selection only;
            the weights use the unbiased scores) and after each step updated by
            b_e += gamma * sign(mean_e' load_e' - load_e) (:func:`updated_bias`; the paper's
            gamma is 0.001). 0 = off: the bias is then not used at all
            [MindFormers ``topk_bias_update_rate``].
        aux_loss: the load-balancing loss :meth:`Router.aux_losses` adds: "none", "switch"
            (Switch Transformers sec. 2.2 eq. 4 with top-k: E * sum_e f_e * P_e, f_e the
            fraction of the T * K assignments routed to e, P_e the mean over tokens of e's
            router probability; the same as GShard's and as :func:`layer.routing_statistics`)
            or "sequence" (DeepSeek-V3's complementary sequence-wise balance loss, sec. 2.1.2
            eqs. 17-20: per sequence of S tokens, sum_e f_e * P_e with f_e = E / (K S) *
            the sequence's assignments to e and P_e the sequence's mean normalised score of e,
            averaged over the B sequences; needs the sequence length).
        aux_loss_coef: the aux loss's coefficient (alpha; > 0 exactly when aux_loss is not
            "none"; Switch used 0.01, DeepSeek-V3 0.0001 for its sequence loss)
            [``aux_loss_alpha``].
        z_loss_coef: coefficient of the ST-MoE router z-loss (Zoph et al. 2022 eq. 5: the
            mean over tokens of logsumexp_e(x_e)^2; 0.001 in ST-MoE); 0 = off.
    """

    score: str = "softmax"
    order: str = "softmax-topk"
    renormalize: bool = True
    scaling_factor: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "top2-sum"
    bias_update_speed: float = 0.0
    aux_loss: str = "none"
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0

    def __post_init__(self):
        for name, allowed in (("score", SCORES), ("order", ORDERS),
                              ("group_score", GROUP_SCORES), ("aux_loss", AUX_LOSSES)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"'{_FIELD}{name}' must be one of {list(allowed)}, but got "
                                 f"{value!r}.")
        if not isinstance(self.renormalize, (bool, np.bool_)):
            raise ValueError(f"'{_FIELD}renormalize' must be a bool (true or false), but got "
                             f"{self.renormalize!r}.")
        if not _is_real(self.scaling_factor) or not self.scaling_factor > 0:
            raise ValueError(f"'{_FIELD}scaling_factor' must be a finite number > 0, but got "
                             f"{self.scaling_factor!r}.")
        for name in ("num_groups", "topk_groups"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"'{_FIELD}{name}' must be an integer >= 1, but got "
                                 f"{value!r}.")
        if self.topk_groups > self.num_groups:
            raise ValueError(f"'{_FIELD}topk_groups' must be at most '{_FIELD}num_groups' = "
                             f"{self.num_groups}, but got {self.topk_groups!r}.")
        for name in ("bias_update_speed", "aux_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            if not _is_real(value) or value < 0:
                raise ValueError(f"'{_FIELD}{name}' must be a finite number >= 0, but got "
                                 f"{value!r}.")
        if self.score == "sigmoid" and self.order != "softmax-topk":
            raise ValueError(f"'{_FIELD}order' {self.order!r} applies to a softmax router "
                             f"only (a sigmoid router scores every expert on its own); with "
                             f"'{_FIELD}score' 'sigmoid' it must be 'softmax-topk', but got "
                             f"{self.order!r}.")
        if (self.aux_loss == "none") != (self.aux_loss_coef == 0):
            if self.aux_loss == "none":
                raise ValueError(f"'{_FIELD}aux_loss_coef' must be 0 when '{_FIELD}aux_loss' "
                                 f"is 'none' (set aux_loss to 'switch' or 'sequence'), but "
                                 f"got {self.aux_loss_coef!r}.")
            raise ValueError(f"'{_FIELD}aux_loss_coef' must be > 0 when '{_FIELD}aux_loss' "
                             f"is {self.aux_loss!r} (or set aux_loss to 'none'), but got "
                             f"{self.aux_loss_coef!r}.")

    @property
    def uses_bias(self) -> bool:
        """Whether the expert bias enters the selection (``bias_update_speed > 0``)."""
        return self.bias_update_speed > 0

    def limits_groups(self) -> bool:
        """Whether group-limited routing masks anything (topk_groups < num_groups)."""
        return self.topk_groups < self.num_groups

    def check(self, num_experts: int, top_k: int) -> None:
        """Check the configuration against E = ``num_experts`` and K = ``top_k``: E and K are
        integers with 1 <= K <= E, G divides E, "top2-sum" has 2 experts per group to sum,
        and K fits in the experts of the kept groups. Raises ValueError naming the field."""
        if not _is_int(num_experts) or num_experts < 1:
            raise ValueError(f"'moe.num_experts' must be an integer >= 1, but got "
                             f"{num_experts!r}.")
        if not _is_int(top_k) or not 1 <= top_k <= num_experts:
            raise ValueError(f"'moe.top_k' must be an integer in [1, {num_experts}] (the "
                             f"number of experts), but got {top_k!r}.")
        g = self.num_groups
        if num_experts % g:
            raise ValueError(f"'{_FIELD}num_groups' must divide the {num_experts} experts "
                             f"into equal groups, but got {g}.")
        per_group = num_experts // g
        if self.limits_groups() and self.group_score == "top2-sum" and per_group < 2:
            raise ValueError(f"'{_FIELD}group_score' 'top2-sum' needs at least 2 experts per "
                             f"group, but '{_FIELD}num_groups' = {g} leaves {per_group} of "
                             f"the {num_experts} experts per group; use 'max' or fewer "
                             f"groups.")
        kept = self.topk_groups * per_group
        if top_k > kept:
            raise ValueError(f"'moe.top_k' must be at most the {kept} experts of the "
                             f"'{_FIELD}topk_groups' = {self.topk_groups} kept groups of "
                             f"{per_group}, but got {top_k}.")


# --- numpy references (float64, from the papers' formulas) ----------------------------------


def _topk_lower_id(values, k: int):
    """(values, indices) of the k largest along the last axis, largest first, ties to the
    lower index (a stable sort of the negated values)."""
    idx = np.argsort(-values, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(values, idx, -1), idx


def router_scores_reference(logits_TE, config: RouterConfig):
    """(probs_TE, base_TE) in float64 from logits [T, E].

    probs_TE: what the aux losses read: softmax(x) over E (softmax routers), or the sigmoid
    scores normalised per token s_e / sum_e' s_e' (DeepSeek-V3 eq. 19's s'). base_TE: the
    selection scores before any bias: softmax(x) ("softmax-topk"), x ("topk-softmax") or
    sigmoid(x)."""
    x = np.asarray(logits_TE, np.float64)
    if config.score == "softmax":
        z = np.exp(x - x.max(axis=-1, keepdims=True))
        probs = z / z.sum(axis=-1, keepdims=True)
        return probs, (probs if config.order == "softmax-topk" else x)
    s = 1.0 / (1.0 + np.exp(-x))
    return s / s.sum(axis=-1, keepdims=True), s


def group_mask_reference(select_TE, config: RouterConfig):
    """bool [T, E]: the experts of the topk_groups best groups of every token (all True
    without a group limit). A group's score is the sum of its two largest selection scores
    ("top2-sum") or its largest ("max"); ties between groups go to the lower group id."""
    select_TE = np.asarray(select_TE, np.float64)
    t, e = select_TE.shape
    g = config.num_groups
    if not config.limits_groups():
        return np.ones((t, e), bool)
    grouped_TGM = select_TE.reshape(t, g, e // g)
    if config.group_score == "top2-sum":
        group_TG = np.sort(grouped_TGM, axis=-1)[..., -2:].sum(axis=-1)
    else:
        group_TG = grouped_TGM.max(axis=-1)
    _, kept_TG = _topk_lower_id(group_TG, config.topk_groups)
    keep_TG = np.zeros((t, g), bool)
    np.put_along_axis(keep_TG, kept_TG, True, axis=-1)
    return np.repeat(keep_TG, e // g, axis=1)


def route_reference(logits_TE, config: RouterConfig, top_k: int, bias_E=None):
    """(weights_TK float64, expert_ids_TK int64): the routing of every token, written from the
    papers' formulas (module docstring, steps 1-7) in float64; ties go to the lower expert
    id. ``bias_E`` [E] is added to the selection scores when ``config.uses_bias`` (ignored
    otherwise, as the Router does); the weights never see it."""
    logits_TE = np.asarray(logits_TE, np.float64)
    t, e = logits_TE.shape
    config.check(e, top_k)
    _, base_TE = router_scores_reference(logits_TE, config)
    select_TE = base_TE
    if config.uses_bias:
        if bias_E is None:
            raise ValueError("a router with 'moe.router.bias_update_speed' > 0 needs bias_E.")
        select_TE = base_TE + np.asarray(bias_E, np.float64).reshape(1, e)
    masked_TE = np.where(group_mask_reference(select_TE, config), select_TE, -np.inf)
    _, ids_TK = _topk_lower_id(masked_TE, top_k)
    chosen_TK = np.take_along_axis(base_TE, ids_TK, -1)
    if config.score == "softmax" and config.order == "topk-softmax":
        z = np.exp(chosen_TK - chosen_TK.max(axis=-1, keepdims=True))
        weights_TK = z / z.sum(axis=-1, keepdims=True)
    else:
        weights_TK = chosen_TK
    if config.renormalize:
        weights_TK = weights_TK / weights_TK.sum(axis=-1, keepdims=True)
    return weights_TK * config.scaling_factor, ids_TK


def aux_loss_reference(probs_TE, expert_ids_TK, kind: str, seq_length: Optional[int] = None):
    """The load-balancing loss (float, without its coefficient) of ``kind``:

    "switch": E * sum_e f_e * P_e, f_e = (assignments to e) / (T K), P_e = mean_t probs[t, e]
        (Switch Transformers eq. 4, top-k assignments counted k times).
    "sequence": mean over the T / S sequences of sum_e f_e * P_e, with, per sequence of S =
        ``seq_length`` consecutive tokens, f_e = E / (K S) * (its assignments to e) and P_e
        = its mean of probs[:, e] (DeepSeek-V3 eqs. 17-20; probs are the normalised scores).
    "none": 0.
    """
    probs_TE = np.asarray(probs_TE, np.float64)
    ids_TK = np.asarray(expert_ids_TK)
    t, e = probs_TE.shape
    k = ids_TK.shape[1]
    if kind == "none":
        return 0.0
    if kind == "switch":
        counts_E = np.bincount(ids_TK.reshape(-1), minlength=e)
        return float(e * np.sum(counts_E / (t * k) * probs_TE.mean(axis=0)))
    if kind != "sequence":
        raise ValueError(f"'moe.router.aux_loss' must be one of {list(AUX_LOSSES)}, but got "
                         f"{kind!r}.")
    _check_seq_length(seq_length, t)
    losses = []
    for start in range(0, t, seq_length):
        ids = ids_TK[start:start + seq_length]
        f_E = e / (k * seq_length) * np.bincount(ids.reshape(-1), minlength=e)
        losses.append(np.sum(f_E * probs_TE[start:start + seq_length].mean(axis=0)))
    return float(np.mean(losses))


def z_loss_reference(logits_TE) -> float:
    """ST-MoE's router z-loss (Zoph et al. 2022 eq. 5), without its coefficient:
    (1 / T) sum_t (log sum_e exp(x_te))^2, in float64."""
    x = np.asarray(logits_TE, np.float64)
    m = x.max(axis=-1)
    lse_T = m + np.log(np.exp(x - m[:, None]).sum(axis=-1))
    return float(np.mean(lse_T ** 2))


def bias_update_reference(bias_E, load_E, speed: float):
    """DeepSeek-V3's bias update (sec. 2.1.2): b_e + gamma * sign(mean_e' load_e' - load_e),
    float32 as the bias is (gamma = ``speed`` rounded to float32, one float32 addition):
    an underloaded expert's bias rises by gamma, an overloaded one's falls, one at the
    mean load keeps its bias."""
    load = np.asarray(load_E, np.float64)
    step_E = np.float32(speed) * np.sign(load.mean() - load).astype(np.float32)
    return (np.asarray(bias_E, np.float32) + step_E).astype(np.float32)


def _check_seq_length(seq_length, tokens: int) -> None:
    if not _is_int(seq_length) or seq_length < 1 or tokens % seq_length:
        raise ValueError(f"the sequence-wise aux loss needs 'seq_length' to be an integer "
                         f">= 1 dividing the {tokens} tokens, but got {seq_length!r}.")


# --- MindSpore ---------------------------------------------------------------------------------


def expert_bias_parameter(num_experts: int, name: str = "expert_bias") -> Parameter:
    """A non-trainable float32 [E] Parameter of zeros: the expert bias of auxiliary-loss-free
    balancing, which a layer passes to :class:`Router` and assigns :func:`updated_bias` to
    after each step."""
    return Parameter(Tensor(np.zeros(num_experts, np.float32)), name=name,
                     requires_grad=False)


def updated_bias(bias_E, counts_E, speed: float):
    """DeepSeek-V3's bias update in MindSpore ops: bias_E + speed * sign(mean(counts_E) -
    counts_E) (float32 [E]; ``counts_E`` the step's assignments per expert, any number
    type). Equal to :func:`bias_update_reference` bit for bit (the mean of integer counts is
    exact in float32 up to 2**24 assignments, so the signs are exact). A layer assigns it
    (``ops.assign(self.expert_bias, updated_bias(...))``) after its step, with its counts
    summed over the data-parallel group if the balance is to be global."""
    load_E = counts_E.astype(ms.float32)
    step_E = ops.sign(load_E.mean() - load_E) * float(np.float32(speed))
    return bias_E + step_E


class Router(nn.Cell):
    """Top-k routing configured by a :class:`RouterConfig`, with TopKArrival's outputs.

    ``construct(logits_TE, bias_E=None) -> (probs_TE, weights_TK, expert_ids_A, onehot_AE,
    position_A)``:

    - probs_TE: float32 [T, E], what the aux losses read: softmax(logits) over E for a
      softmax router (either order), or for a sigmoid router the scores normalised per token,
      s_e / sum_e' s_e' (DeepSeek-V3's s').
    - weights_TK: float32 [T, K], the gate weights of the K chosen experts, largest
      selection score first (module docstring, steps 5-7).
    - expert_ids_A: int32 [A], A = K * T, k-major (a = k * T + t).
    - onehot_AE: float32 [A, E], one-hot rows of expert_ids_A.
    - position_A: int32 [A], the assignment's place among the earlier assignments (in
      k-major order) to the same expert.

    ``bias_E``: float32 [E], the expert bias (:func:`expert_bias_parameter`), read when
    ``config.bias_update_speed > 0`` (pass zeros or nothing otherwise: it is not used).

    Parameter-free, like TopKArrival: the router's weights (the logits' Dense) stay in the
    layer. With ``RouterConfig()`` the outputs equal ``TopKArrival(E, K)``'s bit for bit (the
    same ops in the same order), and ``RouterConfig(renormalize=False)`` those of
    ``TopKArrival(E, K, renormalize=False)``.
    """

    def __init__(self, num_experts: int, top_k: int, config: Optional[RouterConfig] = None):
        super().__init__()
        config = RouterConfig() if config is None else config
        if not isinstance(config, RouterConfig):
            raise ValueError(f"'config' must be a RouterConfig, but got "
                             f"{type(config).__name__}.")
        config.check(num_experts, top_k)
        self.config = config
        self.num_experts = int(num_experts)
        self.top_k = int(top_k)
        self.sigmoid_score = config.score == "sigmoid"
        self.softmax_over_topk = config.score == "softmax" and config.order == "topk-softmax"
        self.renormalize = bool(config.renormalize)
        self.scaling_factor = float(config.scaling_factor)
        self.scaled = self.scaling_factor != 1.0
        self.uses_bias = config.uses_bias
        self.limits_groups = config.limits_groups()
        self.num_groups = int(config.num_groups)
        self.topk_groups = int(config.topk_groups)
        self.group_top2 = config.group_score == "top2-sum"
        self.aux_kind = config.aux_loss
        self.aux_coef = float(config.aux_loss_coef)
        self.z_coef = float(config.z_loss_coef)
        self.softmax = nn.Softmax(axis=-1)
        self.one_hot = ops.OneHot()
        self.on = Tensor(1.0, ms.float32)
        self.off = Tensor(0.0, ms.float32)
        self.masked = Tensor(-np.inf, ms.float32)
        logger.debug("Router(E=%d, K=%d): %s", num_experts, top_k, config)

    def construct(self, logits_TE, bias_E=None):
        logits_TE = logits_TE.astype(ms.float32)
        # step 1: scores; base_TE: the selection scores before the bias, whose values the
        # weights take
        if self.sigmoid_score:
            base_TE = ops.sigmoid(logits_TE)
            probs_TE = base_TE / base_TE.sum(axis=-1, keepdims=True)
        else:
            probs_TE = self.softmax(logits_TE)
            base_TE = logits_TE if self.softmax_over_topk else probs_TE
        # steps 2-4: selection (biased), group limit, top-k
        select_TE = base_TE
        if self.uses_bias:
            if bias_E is None:
                raise ValueError("a Router with 'moe.router.bias_update_speed' > 0 needs "
                                 "bias_E, the float32 [E] expert bias.")
            select_TE = base_TE + bias_E.astype(ms.float32).reshape(1, -1)
        if self.limits_groups:
            select_TE = self._group_limited(select_TE)
        chosen_TK, expert_ids_TK = ops.topk(select_TE, self.top_k)
        if self.uses_bias:
            chosen_TK = ops.gather_elements(base_TE, 1, expert_ids_TK)
        # steps 5-7: weights
        weights_TK = self.softmax(chosen_TK) if self.softmax_over_topk else chosen_TK
        if self.renormalize:
            weights_TK = weights_TK / weights_TK.sum(axis=-1, keepdims=True)
        if self.scaled:
            weights_TK = weights_TK * self.scaling_factor
        # assignments in k-major order, as TopKArrival
        expert_ids_A = expert_ids_TK.transpose(1, 0).reshape(-1)
        onehot_AE = self.one_hot(expert_ids_A, self.num_experts, self.on, self.off)
        position_A = ((ops.cumsum(onehot_AE, 0) - 1.0) * onehot_AE).sum(axis=-1)
        return probs_TE, weights_TK, expert_ids_A, onehot_AE, position_A.astype(ms.int32)

    def _group_limited(self, select_TE):
        """select_TE with the experts outside each token's topk_groups best groups set to
        -inf (DeepSeek-V2/V3 group-limited routing)."""
        t, e = select_TE.shape
        g = self.num_groups
        grouped_TGM = select_TE.reshape(t, g, e // g)
        if self.group_top2:
            group_TG = ops.topk(grouped_TGM, 2)[0].sum(axis=-1)
        else:
            group_TG = grouped_TGM.max(axis=-1)
        _, kept_TJ = ops.topk(group_TG, self.topk_groups)          # J = topk_groups
        keep_TG = self.one_hot(kept_TJ, g, self.on, self.off).sum(axis=1)
        keep_TE = ops.broadcast_to(keep_TG.reshape(t, g, 1), (t, g, e // g)).reshape(t, e)
        return ops.select(keep_TE > 0.5, select_TE, ops.broadcast_to(self.masked, (t, e)))

    def aux_losses(self, logits_TE, probs_TE, onehot_AE, seq_length=None):
        """The configured total balancing loss, float32 scalar: aux_loss_coef * (the
        "switch" or "sequence" loss of :func:`aux_loss_reference`, from this Router's
        ``probs_TE`` and ``onehot_AE``) + z_loss_coef * the router z-loss of ``logits_TE``
        (:func:`z_loss_reference`); 0 when neither is configured. ``seq_length``: S, a Python
        int dividing T (the sequence loss needs it; the tokens of a sequence are
        consecutive rows). Callable from a layer's ``construct`` (GRAPH_MODE)."""
        total = ops.zeros((), ms.float32)
        e, k = self.num_experts, self.top_k
        if self.aux_kind == "switch":
            # the same expression as layer.routing_statistics
            loss = e * (onehot_AE.mean(axis=0) * probs_TE.mean(axis=0)).sum()
            total = total + self.aux_coef * loss
        elif self.aux_kind == "sequence":
            t = probs_TE.shape[0]
            if seq_length is None or seq_length < 1 or t % seq_length != 0:
                raise ValueError("the sequence-wise aux loss needs 'seq_length', an integer "
                                 ">= 1 dividing the tokens of the batch.")
            b = t // seq_length
            counts_BE = onehot_AE.reshape(k, b, seq_length, e).sum(axis=(0, 2))
            mean_BE = probs_TE.reshape(b, seq_length, e).mean(axis=1)
            loss = (counts_BE * mean_BE).sum() * (e / (k * seq_length * b))
            total = total + self.aux_coef * loss
        if self.z_coef > 0:
            lse_T = ops.logsumexp(logits_TE.astype(ms.float32), -1)
            total = total + self.z_coef * (lse_T * lse_T).mean()
        return total
