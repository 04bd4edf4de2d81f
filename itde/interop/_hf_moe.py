r"""The weight glue of the sparse mixtures of experts (Mixtral, Qwen2-MoE): a layer's
`mlp` (`gate`, the router; `experts`, the stacked expert weights; a `shared_expert` and its
`shared_expert_gate` where the family has them) read into a
[`MixtureOfExperts`][itde.MixtureOfExperts], and written back. Every function is exact (a
slice or a transpose)."""

from __future__ import annotations

import numpy as np

from .._operators._experts import MixtureOfExperts, RenormalisedTopK, SoftmaxTopK
from .._operators._feedforward import GatedFeedForward
from . import _hf_glue as g
from ._torch import _np


def routing(top_k: int, renormalise: bool):
    """The routing of `top_k` experts per token, renormalised over them or not."""
    return RenormalisedTopK(int(top_k)) if renormalise else SoftmaxTopK(int(top_k))


def experts(hf_experts, activation: str) -> GatedFeedForward:
    """The stacked experts of a `<Family>Experts` (`gate_up_proj` `[experts, 2 hidden,
    features]`, gate first; `down_proj` `[experts, features, hidden]`) as one
    `GatedFeedForward` with a leading expert axis."""
    gate_up, down = _np(hf_experts.gate_up_proj), _np(hf_experts.down_proj)
    hidden = gate_up.shape[1] // 2
    return GatedFeedForward(
        w_gate=gate_up[:, :hidden].transpose(0, 2, 1),
        w1=gate_up[:, hidden:].transpose(0, 2, 1),
        w2=down.transpose(0, 2, 1),
        b_gate=None,
        b1=None,
        b2=None,
        activation=activation,
    )


def mixture(mlp, activation: str, top_k: int, renormalise: bool) -> MixtureOfExperts:
    """A sparse `mlp` block: its router `gate.weight` `[experts, features]`, its `experts`,
    and its `shared_expert` (a gated `mlp`) with its `shared_expert_gate` where it has them."""
    shared = getattr(mlp, "shared_expert", None)
    gate = getattr(mlp, "shared_expert_gate", None)
    return MixtureOfExperts(
        router=_np(mlp.gate.weight).T,
        experts=experts(mlp.experts, activation),
        routing=routing(top_k, renormalise),
        shared=None if shared is None else g.gated_feedforward(
            shared.gate_proj, shared.up_proj, shared.down_proj, activation),
        shared_gate=None if gate is None else g.lin(gate)[:, 0],
    )  # fmt: skip


def put_mixture(ff: MixtureOfExperts, mlp) -> None:
    """Write `ff` into the sparse `mlp` block (the inverse of `mixture`)."""
    if not isinstance(ff, MixtureOfExperts):
        raise TypeError(
            f"`to_hf`: the layer's feed-forward is a {type(ff).__name__}, and this model's "
            "layer is a sparse mixture of experts; write a MixtureOfExperts."
        )
    g.put(mlp.gate.weight, ff.router, transpose=True)
    e = ff.experts
    gate_up = np.concatenate([np.asarray(e.w_gate), np.asarray(e.w1)], axis=-1)
    g.put(mlp.experts.gate_up_proj, gate_up.transpose(0, 2, 1))
    g.put(mlp.experts.down_proj, np.asarray(e.w2).transpose(0, 2, 1))
    shared = getattr(mlp, "shared_expert", None)
    if (shared is None) != (ff.shared is None):
        raise ValueError(
            "`to_hf`: the model's mixture of experts "
            f"{'has no' if ff.shared is None else 'has a'} shared expert, and the module "
            f"{'has one' if shared is not None else 'has none'}; the config does not describe "
            "these weights."
        )
    if shared is not None:
        if ff.shared_gate is None:
            raise ValueError(
                "`to_hf`: the model's shared expert has no `shared_gate`, and the module's "
                "shared expert is gated by `shared_expert_gate`; give it a gate."
            )
        g.put_gated_feedforward(ff.shared, shared.gate_proj, shared.up_proj, shared.down_proj)
        g.put(mlp.shared_expert_gate.weight, np.asarray(ff.shared_gate)[None])


def router_float64(self, hidden_states):
    """Mixtral's router computing its softmax in the input's dtype when it is float64
    (Hugging Face computes it in float32: `router_logits.float()`)."""
    import torch

    if hidden_states.dtype != torch.float64:
        return router_float64.original(self, hidden_states)
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    probs = torch.nn.functional.softmax(logits, dim=-1)
    top, index = torch.topk(probs, self.top_k, dim=-1)
    top /= top.sum(dim=-1, keepdim=True)
    return logits, top, index
