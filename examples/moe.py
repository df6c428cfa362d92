"""A transformer-free mixture-of-experts regressor with GShard/Switch-style dispatch.

tokens x [G, S, d_in] (G groups of S tokens) -> tanh input projection -> n_moe_layers
residual MoE feed-forward layers (top-k routing with a fixed expert capacity per group)
-> linear head -> MSE (+ a small Switch load-balancing term).

As in GShard, tokens are routed within their group: groups are independent, so a mesh
axis can split them (data parallelism) while the same axis splits the experts; the
dispatched tokens then move from group-split to expert-split by an all-to-all, and
back for the combine.

Parameters (D = d_model, F = d_ff, E = n_experts)::

    input:   {w [d_in, D], b [D]}
    moe[i]:  {router [D, E], experts: {w1 [E, D, F], w2 [E, F, D]}}
    head:    {w [D, d_out], b [d_out]}

Batch: ``{'x': f32[G, S, d_in], 'y': f32[G, S, d_out]}``.

``MIXTRAL_8X7B`` is a config shaped like Mixtral 8x7B's expert layers, for
``abstract=True`` use; ``SCHEDULES`` holds expert schedules (expert and data
parallelism) written with the project's tactics.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from examples._common import build_train_step, dense_init, normal


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sizes, routing settings and optimiser settings of the MoE example."""

    groups: int = 8
    group_size: int = 8
    d_in: int = 16
    d_model: int = 32
    d_ff: int = 64
    d_out: int = 8
    n_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 2.0
    n_moe_layers: int = 1
    aux_loss_coef: float = 1e-2
    learning_rate: float = 1e-3
    adam_eps: float = 1e-8

    @property
    def tokens(self) -> int:
        """Tokens per batch: ``groups * group_size``."""
        return self.groups * self.group_size

    @property
    def capacity(self) -> int:
        """Slots per expert and group: ``capacity_factor * k * S / E``, rounded up."""
        return math.ceil(self.capacity_factor * self.top_k * self.group_size / self.n_experts)


#: Mixtral 8x7B's feed-forward stack: 32 MoE layers of 8 experts, top-2 routing, width 4096,
#: expert hidden width 14336; 64 sequences of 4096 tokens, routed in groups of 1024 tokens
#: (256 groups). The regressor's input and targets are hidden states of width d_model
#: (d_in = d_out = 4096), as if the stack were the feed-forward halves of Mixtral's blocks
#: fed the residual stream. Its experts are two-matrix gelu MLPs, where Mixtral's are
#: three-matrix SwiGLU ones, and it has no attention or embeddings, so it holds about
#: 30.1e9 parameters where Mixtral holds 46.7e9. For ``abstract=True`` use only.
MIXTRAL_8X7B = MoEConfig(groups=256, group_size=1024, d_in=4096, d_model=4096, d_ff=14336, d_out=4096,
                         n_experts=8, top_k=2, n_moe_layers=32)


def init_params(config: MoEConfig, key: jax.Array) -> dict:
    """Weights scaled by 1/sqrt(fan_in) (per expert for expert weights); zero biases."""
    d, f, e = config.d_model, config.d_ff, config.n_experts
    k_in, k_head, k_moe = jax.random.split(key, 3)
    moe = []
    for k in jax.random.split(k_moe, config.n_moe_layers):
        kr, k1, k2 = jax.random.split(k, 3)
        moe.append({
            "router": dense_init(kr, d, (d, e)),
            "experts": {"w1": dense_init(k1, d, (e, d, f)), "w2": dense_init(k2, f, (e, f, d))},
        })
    return {
        "input": {"w": dense_init(k_in, config.d_in, (config.d_in, d)),
                  "b": jnp.zeros((d,), jnp.float32)},
        "moe": moe,
        "head": {"w": dense_init(k_head, d, (d, config.d_out)),
                 "b": jnp.zeros((config.d_out,), jnp.float32)},
    }


def make_batch(config: MoEConfig, key: jax.Array) -> dict:
    """Random inputs with targets from a fixed smooth teacher."""
    kx, kt = jax.random.split(key)
    x = normal(kx, (config.groups, config.group_size, config.d_in))
    teacher = dense_init(kt, config.d_in, (config.d_in, config.d_out))
    return {"x": x, "y": jnp.sin(x @ teacher)}


def route(router_probs: jax.Array, config: MoEConfig):
    """Top-k capacity routing of one group's ``router_probs [T, E]``.

    Returns ``(dispatch [T, E, C], combine [T, E, C])``: ``dispatch`` is a 0/1 mask
    placing each kept (token, choice) in a slot of its expert, ``combine`` is that mask
    weighted by the renormalised gate value. Assignments beyond an expert's capacity
    are dropped (their rows are zero), as in GShard/Switch.
    """
    t, e = router_probs.shape
    k, c = config.top_k, config.capacity
    gates, experts = jax.lax.top_k(router_probs, k)  # [T, k]
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    onehot = jax.nn.one_hot(experts, e, dtype=jnp.int32)  # [T, k, E]
    # Order assignments choice-major (every token's 1st choice before any 2nd
    # choice), so first choices win capacity; the running count per expert is
    # then each assignment's slot.
    flat = onehot.transpose(1, 0, 2).reshape(k * t, e)
    slot = jnp.sum((jnp.cumsum(flat, axis=0) - 1) * flat, axis=-1)  # [k*T]
    slot = slot.reshape(k, t).T  # [T, k]
    # one_hot of a slot >= C is all zeros: that assignment is dropped.
    slot_onehot = jax.nn.one_hot(slot, c, dtype=router_probs.dtype)  # [T, k, C]
    onehot = onehot.astype(router_probs.dtype)
    dispatch = jnp.einsum("tke,tkc->tec", onehot, slot_onehot)
    combine = jnp.einsum("tk,tke,tkc->tec", gates, onehot, slot_onehot)
    return dispatch, combine


def moe_layer(p: dict, x: jax.Array, config: MoEConfig):
    """One MoE feed-forward layer on ``x [G, S, D]``; returns ``(y [G, S, D], aux_loss)``."""
    probs = jax.nn.softmax(x @ p["router"], axis=-1)  # [G, S, E]
    dispatch, combine = jax.vmap(lambda pr: route(pr, config))(probs)  # [G, S, E, C]
    expert_in = jnp.einsum("gsec,gsd->egcd", dispatch, x)
    h = jax.nn.gelu(jnp.einsum("egcd,edf->egcf", expert_in, p["experts"]["w1"]), approximate=True)
    expert_out = jnp.einsum("egcf,efd->egcd", h, p["experts"]["w2"])
    y = jnp.einsum("gsec,egcd->gsd", combine, expert_out)
    # Switch-style load-balancing loss: E * sum_e (share of assignments kept by e) *
    # (mean router prob of e). The share comes from the dispatch mask (no gradient),
    # which avoids a second, argmax-based routing decision.
    share = jnp.sum(dispatch, axis=(0, 1, 3)) / (config.top_k * config.tokens)
    aux = config.n_experts * jnp.sum(share * jnp.mean(probs, axis=(0, 1)))
    return y, aux


def forward(params: dict, x: jax.Array, config: MoEConfig):
    """Predictions ``[G, S, d_out]`` and the summed auxiliary loss."""
    h = jnp.tanh(x @ params["input"]["w"] + params["input"]["b"])
    aux_total = jnp.zeros((), h.dtype)
    for p in params["moe"]:
        y, aux = moe_layer(p, h, config)
        h, aux_total = h + y, aux_total + aux
    return h @ params["head"]["w"] + params["head"]["b"], aux_total


def loss_fn(params: dict, batch: dict, config: MoEConfig) -> jax.Array:
    """MSE against ``batch['y']`` plus ``aux_loss_coef`` times the balancing loss."""
    pred, aux = forward(params, batch["x"], config)
    return jnp.mean((pred - batch["y"]) ** 2) + config.aux_loss_coef * aux


def init(config: MoEConfig, key: jax.Array) -> tuple[dict, dict]:
    """Deterministic ``(params, batch)`` from ``key``."""
    kp, kb = jax.random.split(key)
    return init_params(config, kp), make_batch(config, kb)


def make_train_step(config: MoEConfig | None = None, *, abstract: bool = False, seed: int = 0):
    """Return ``(step, (params, opt_state, batch))`` for the MoE (see package docs)."""
    return build_train_step(loss_fn, init, config or MoEConfig(), abstract=abstract, seed=seed)


def factory():
    """``make_train_step()`` with the default config."""
    return make_train_step()


def param_count(config: MoEConfig) -> int:
    """The number of parameters ``config`` implies (input projection, MoE layers, head)."""
    d, e = config.d_model, config.n_experts
    layer = d * e + 2 * e * d * config.d_ff
    return (config.d_in + 1) * d + config.n_moe_layers * layer + (d + 1) * config.d_out


# -- expert schedules ----------------------------------------------------------------------
# `tactics` is imported where a schedule is built, so that importing the examples stays
# cheap and free of the partitioner.


def ep_dp(expert: str = "expert", data: str = "data") -> list:
    """GShard's recipe, for a ``data=8, expert=8`` mesh: experts split over ``expert``
    and the token groups over both axes; the dispatched tokens reach their experts by an
    all-to-all over ``expert``; dense weights (router, projections) replicated, their
    gradients all-reduced."""
    import tactics

    return [tactics.ExpertParallel(expert), tactics.DataParallel(data)]


def ep_fsdp(expert: str = "expert", data: str = "data") -> list:
    """``ep_dp`` with the parameters (experts included) also sharded over ``data``:
    all-gathered where used, gradients reduce-scattered (ZeRO-3 on the data axis)."""
    import tactics

    return [tactics.ExpertParallel(expert), tactics.FSDP(data, leave_room=False)]


#: Schedule name -> function of the mesh axis names returning a list of tactics for
#: ``tactics.apply_schedule``, e.g. ``SCHEDULES["ep+dp"](expert="expert", data="data")``.
SCHEDULES = {
    "ep+dp": ep_dp,
    "ep+fsdp": ep_fsdp,
}
