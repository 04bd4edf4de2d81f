"""itde: the Transformer solved as an integro-differential equation in depth-time.

Tai, Liu, Li and Chan, "A Mathematical Explanation of Transformers" (SIAM J. Imaging
Sciences, 2026): self-attention is a nonlocal integral operator discretised by
quadrature, layer normalisation a projection onto a constraint set, and one Lie
operator-splitting step with $\\Delta t = 1$ exactly one post-LN Transformer block.
"""

# Lazy exports (PEP 562): `import itde` loads no JAX; a name is imported from its module the
# first time it is used, so `itde --help` answers at once. One name per line: name -> module.
import importlib as _importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:  # the same names, imported eagerly for type checkers and the API docs
    from ._abstract import (  # noqa: F401
        AbstractEquation,
    )
    from ._blocks import (  # noqa: F401
        AbstractBlockForm,
        OutputNorm,
        Parallel,
        PostNorm,
        PreNorm,
        SandwichNorm,
    )
    from ._buckets import (  # noqa: F401
        AbstractTokenBuckets,
        BlockBuckets,
        PowerOfTwoBuckets,
    )
    from ._compilation_cache import (  # noqa: F401
        enable_compilation_cache,
    )
    from ._config import (  # noqa: F401
        ConfigError,
    )
    from ._continuum import (  # noqa: F401
        continuum_form,
    )
    from ._controls import (  # noqa: F401
        AbstractBlock,
        AbstractControls,
        Block,
        LegendreControls,
        PiecewiseConstant,
        stack,
    )
    from ._equation import (  # noqa: F401
        TransformerIDE,
    )
    from ._fitted import (  # noqa: F401
        SplineControls,
        fit_residuals,
    )
    from ._generate import (  # noqa: F401
        AbstractDecoder,
    )
    from ._kv_cache import (  # noqa: F401
        LIE_STEPS,
        KVCache,
        NotCacheableError,
        check_cacheable,
        decode,
        empty_cache,
        n_evaluations,
        prefill,
        prefill_by_chunks,
        split_layers,
    )
    from ._operators._abstract import (  # noqa: F401
        AbstractAttention,
        AbstractFeedForward,
        AbstractNorm,
    )
    from ._operators._affine import (  # noqa: F401
        FeatureAffine,
    )
    from ._operators._attention import (  # noqa: F401
        Attention,
    )
    from ._operators._bias import (  # noqa: F401
        AbstractPositionBias,
        AbstractScoreBias,
        ALiBi,
        DiscreteBias,
        T5RelativeBias,
        alibi_slopes,
        t5_bucket,
    )
    from ._operators._blocked import (  # noqa: F401
        blocked_attention,
        dense_attention,
        fused_attention,
    )
    from ._operators._cores import (  # noqa: F401
        AbstractAttentionCore,
        Blocked,
        Dense,
        Fused,
    )
    from ._operators._experts import (  # noqa: F401
        AbstractRouting,
        MixtureOfExperts,
        RenormalisedTopK,
        SoftmaxTopK,
    )
    from ._operators._feedforward import (  # noqa: F401
        FeedForward,
        GatedFeedForward,
    )
    from ._operators._layernorm import (  # noqa: F401
        LayerNormProjection,
    )
    from ._operators._qknorm import (  # noqa: F401
        AbstractQueryKeyNorm,
        JointQKNorm,
        PerHeadQKNorm,
    )
    from ._operators._rmsnorm import (  # noqa: F401
        RMSNormProjection,
    )
    from ._operators._rope import (  # noqa: F401
        Rope,
    )
    from ._operators._softcap import (  # noqa: F401
        SoftCap,
    )
    from ._operators._window import (  # noqa: F401
        LayerWindow,
        SlidingWindow,
        TokenBand,
    )
    from ._programs import (  # noqa: F401
        ProgramCache,
        count_compilations,
        programs,
    )
    from ._quadrature._domain import (  # noqa: F401
        AbstractTokenDomain,
    )
    from ._quadrature._grid2d import (  # noqa: F401
        TensorGrid2D,
    )
    from ._quadrature._padded import (  # noqa: F401
        PaddedTokens,
    )
    from ._quadrature._rules import (  # noqa: F401
        RULES,
        AbstractQuadrature,
        GaussLegendre,
        Grid,
        Midpoint,
        PeriodicTrapezoid,
        Simpson,
        Trapezoid,
    )
    from ._quadrature._volterra import (  # noqa: F401
        AbstractVolterraWeights,
        GregoryVolterra,
        MidpointVolterra,
        SpectralVolterra,
        TrapezoidVolterra,
        volterra_weights,
    )
    from ._registry import (  # noqa: F401
        ACTIVATIONS,
        ATTENTION_CORES,
        BLOCK_FORMS,
        FFN_FORMS,
        NORMS,
        QK_NORMS,
        ROUTERS,
        SCHEMES,
        TERMS_KINDS,
        Scheme,
    )
    from ._roles import (  # noqa: F401
        parameter_roles,
    )
    from ._solve import (  # noqa: F401
        DepthStepWarning,
        solve,
    )
    from .function import (  # noqa: F401
        FourierBasis,
        FunctionAttention,
        FunctionBias,
        FunctionBlock,
        FunctionFeedForward,
        FunctionField,
        FunctionKernel,
        LegendreBasis,
    )
    from .interop._hf import (  # noqa: F401
        from_hf,
    )
    from .interop._hf_export import (  # noqa: F401
        to_hf,
    )
    from .interop._hf_lm import (  # noqa: F401
        HFCausalLM,
    )
    from .interop._hf_model import (  # noqa: F401
        HFTransformer,
    )
    from .interop._hf_vit import (  # noqa: F401
        HFVisionTransformer,
    )
    from .interop._torch import (  # noqa: F401
        from_torch,
        to_torch,
    )


_EXPORTS = {
    "ACTIVATIONS": "._registry",
    "ATTENTION_CORES": "._registry",
    "NORMS": "._registry",
    "QK_NORMS": "._registry",
    "AbstractQueryKeyNorm": "._operators._qknorm",
    "PerHeadQKNorm": "._operators._qknorm",
    "JointQKNorm": "._operators._qknorm",
    "AbstractBlockForm": "._blocks",
    "PostNorm": "._blocks",
    "PreNorm": "._blocks",
    "Parallel": "._blocks",
    "SandwichNorm": "._blocks",
    "OutputNorm": "._blocks",
    "AbstractBlock": "._controls",
    "AbstractAttentionCore": "._operators._cores",
    "Dense": "._operators._cores",
    "Blocked": "._operators._cores",
    "Fused": "._operators._cores",
    "AbstractPositionBias": "._operators._bias",
    "parameter_roles": "._roles",
    "AbstractControls": "._controls",
    "AbstractEquation": "._abstract",
    "ConfigError": "._config",
    "enable_compilation_cache": "._compilation_cache",
    "FFN_FORMS": "._registry",
    "SCHEMES": "._registry",
    "Scheme": "._registry",
    "TERMS_KINDS": "._registry",
    "AbstractAttention": "._operators._abstract",
    "AbstractFeedForward": "._operators._abstract",
    "RULES": "._quadrature._rules",
    "AbstractQuadrature": "._quadrature._rules",
    "AbstractTokenDomain": "._quadrature._domain",
    "Attention": "._operators._attention",
    "Block": "._controls",
    "FeedForward": "._operators._feedforward",
    "FourierBasis": ".function",
    "FunctionAttention": ".function",
    "FunctionBias": ".function",
    "FunctionBlock": ".function",
    "FunctionFeedForward": ".function",
    "FunctionField": ".function",
    "FunctionKernel": ".function",
    "LegendreBasis": ".function",
    "TensorGrid2D": "._quadrature._grid2d",
    "PaddedTokens": "._quadrature._padded",
    "AbstractTokenBuckets": "._buckets",
    "BlockBuckets": "._buckets",
    "PowerOfTwoBuckets": "._buckets",
    "blocked_attention": "._operators._blocked",
    "dense_attention": "._operators._blocked",
    "fused_attention": "._operators._blocked",
    "GaussLegendre": "._quadrature._rules",
    "Grid": "._quadrature._rules",
    "LayerNormProjection": "._operators._layernorm",
    "LegendreControls": "._controls",
    "SplineControls": "._fitted",
    "fit_residuals": "._fitted",
    "Midpoint": "._quadrature._rules",
    "PeriodicTrapezoid": "._quadrature._rules",
    "PiecewiseConstant": "._controls",
    "Simpson": "._quadrature._rules",
    "TransformerIDE": "._equation",
    "Trapezoid": "._quadrature._rules",
    "from_torch": ".interop._torch",
    "solve": "._solve",
    "stack": "._controls",
    "to_torch": ".interop._torch",
    "AbstractNorm": "._operators._abstract",
    "BLOCK_FORMS": "._registry",
    "GatedFeedForward": "._operators._feedforward",
    "MixtureOfExperts": "._operators._experts",
    "AbstractRouting": "._operators._experts",
    "SoftmaxTopK": "._operators._experts",
    "RenormalisedTopK": "._operators._experts",
    "ROUTERS": "._registry",
    "RMSNormProjection": "._operators._rmsnorm",
    "Rope": "._operators._rope",
    "SlidingWindow": "._operators._window",
    "LayerWindow": "._operators._window",
    "SoftCap": "._operators._softcap",
    "TokenBand": "._operators._window",
    "HFTransformer": ".interop._hf_model",
    "HFVisionTransformer": ".interop._hf_vit",
    "HFCausalLM": ".interop._hf_lm",
    "from_hf": ".interop._hf",
    "to_hf": ".interop._hf_export",
    "AbstractScoreBias": "._operators._bias",
    "ALiBi": "._operators._bias",
    "DiscreteBias": "._operators._bias",
    "T5RelativeBias": "._operators._bias",
    "alibi_slopes": "._operators._bias",
    "t5_bucket": "._operators._bias",
    "AbstractVolterraWeights": "._quadrature._volterra",
    "GregoryVolterra": "._quadrature._volterra",
    "MidpointVolterra": "._quadrature._volterra",
    "SpectralVolterra": "._quadrature._volterra",
    "TrapezoidVolterra": "._quadrature._volterra",
    "volterra_weights": "._quadrature._volterra",
    "FeatureAffine": "._operators._affine",
    "continuum_form": "._continuum",
    "DepthStepWarning": "._solve",
    "KVCache": "._kv_cache",
    "LIE_STEPS": "._kv_cache",
    "NotCacheableError": "._kv_cache",
    "check_cacheable": "._kv_cache",
    "decode": "._kv_cache",
    "empty_cache": "._kv_cache",
    "n_evaluations": "._kv_cache",
    "AbstractDecoder": "._generate",
    "ProgramCache": "._programs",
    "count_compilations": "._programs",
    "programs": "._programs",
    "prefill": "._kv_cache",
    "prefill_by_chunks": "._kv_cache",
    "split_layers": "._kv_cache",
}
#: Subpackages reachable as attributes (`itde.train` after `import itde`), loaded on use.
_SUBPACKAGES = ("analysis", "cli", "data", "function", "interop", "studies", "train")


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(_importlib.import_module(module, __name__), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    if name in _SUBPACKAGES:
        return _importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBPACKAGES))


#: The public names: the keys of `_EXPORTS` (the `TYPE_CHECKING` block names the same ones, from
#: the same modules: tests/test_cli_help.py).
__all__ = list(_EXPORTS)
