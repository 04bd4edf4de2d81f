"""The operators of the equation on a discretised domain: attention, feed-forward, projection."""

from ._abstract import AbstractAttention, AbstractFeedForward
from ._attention import Attention
from ._blocked import blocked_attention, dense_attention, fused_attention
from ._feedforward import FeedForward
from ._layernorm import LayerNormProjection

__all__ = [
    "AbstractAttention",
    "AbstractFeedForward",
    "Attention",
    "FeedForward",
    "LayerNormProjection",
    "blocked_attention",
    "dense_attention",
    "fused_attention",
]
