r"""Spectra over depth: the eigenvalues and singular values of each head's attention form and
value-output map, and the singular values of the feed-forward's kernels, at any depth.

**What is computed.** For head $m$ of the attention at depth $t$ (with grouped-query
attention $g(m)$ is the key/value head query head $m$ reads, as the operator applies it):

- the bilinear form of the scores, $B_m = W^Q_m {W^K_{g(m)}}^\top$ ($d \times d$): the score is
  $s_m(x, \tilde x) = \langle u(x), B_m u(\tilde x)\rangle / \sqrt{|\Omega_h|}$ (the
  $1/\sqrt{|\Omega_h|}$ is not included);
- the value-output map, $C_m = W^V_{g(m)} W^O_m$ ($d \times d$): what head $m$ adds to a token
  is $\sum_{\tilde x} \gamma_m(x, \tilde x)\, u(\tilde x)\, C_m$;
- the feed-forward's kernels $W_1$ ($d \times d_\mathrm{ff}$), $W_2$
  ($d_\mathrm{ff} \times d$) and, for a gated one, $W_\mathrm{gate}$: the singular values
  of each, and the eigenvalues of their product $W_1 W_2$ ($d \times d$, the map a token
  goes through in the feed-forward with its activation taken away; for a gated one the
  up and down kernels, the gate left out). That product is Tong et al.'s feed-forward
  spectrum (ICLR 2025, "Neural ODE Transformers"; `qkvflow/analysis/spectral.py`,
  `examine_FF_spectra_info`: the eigenvalues of `c_fc.weight @ c_proj.weight`, GPT-2's
  $[d, d_\mathrm{ff}]$ and $[d_\mathrm{ff}, d]$ kernels). They keep all $d$ of them,
  sorted by real part, and store the real parts only; here the
  $\min(d, d_\mathrm{ff})$ that can be nonzero, complex, by decreasing modulus.

**Quadrature weights.** On a grid with feature weights $w$ (and head weights $w_h$, hidden
weights $w_z$ for function kernels) the kernels are those of integral operators on
$L^2(\Omega_y)$: $B_m$ has kernel $b_m(\xi, \eta) = \int_{\Omega_h} W^Q_m(\xi, e) W^K(\eta, e)\,de$,
and the matrix of that operator in an orthonormal basis of the discrete $L^2_w$ is
$D_w^{1/2}\, W^Q_m D_{w_h} {W^K}^\top D_w^{1/2}$ ($D_w = \mathrm{diag}(w)$); likewise
$D_w^{1/2} W^V D_{w_h} W^O D_w^{1/2}$, $D_w^{1/2} W_1 D_{w_z}^{1/2}$,
$D_{w_z}^{1/2} W_2 D_w^{1/2}$ and $D_w^{1/2} W_1 D_{w_z} W_2 D_w^{1/2}$. Their eigenvalues
are the Nyström eigenvalues of the continuous operators (those of
$W^Q D_{w_h} {W^K}^\top D_w$, a similar matrix), and they converge with the grid; on the
unit grid (every weight 1) they are the plain matrices'.

**Cost.** $B_m$ has rank at most $k = \min(d, d_\mathrm{head})$, so its spectrum is taken
from $k \times k$ matrices: the nonzero eigenvalues of $A B^\top$ are those of $B^\top A$,
and its singular values are those of $R_A R_B^\top$ from the QR factors $A = Q_A R_A$,
$B = Q_B R_B$ (the other $d - k$ eigenvalues and singular values are exactly 0 and are not
returned). One depth costs $O(h\,d\,k^2)$, not $O(h\,d^3)$. Likewise $C_m$ with the value
size.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Complex, Float

from .._controls import PiecewiseConstant
from .._equation import TransformerIDE
from .._operators._attention import Attention
from ._common import _one_at_a_time, equation_of


class HeadSpectra(eqx.Module):
    r"""The spectra of one attention's heads (one depth): arrays indexed `[head, k]`.

    - `qk_eigenvalues`: the nonzero eigenvalues of $B_m = W^Q_m {W^K_{g(m)}}^\top$ (complex),
      $k = \min(d, d_\mathrm{head})$, sorted by decreasing modulus (of a conjugate pair, the
      one with positive imaginary part first).
    - `qk_singular_values`: its singular values, decreasing.
    - `vo_eigenvalues`, `vo_singular_values`: the same for $C_m = W^V_{g(m)} W^O_m$,
      $k = \min(d, d_v)$.
    """

    qk_eigenvalues: Complex[Array, "heads k"]
    qk_singular_values: Float[Array, "heads k"]
    vo_eigenvalues: Complex[Array, "heads kv"]
    vo_singular_values: Float[Array, "heads kv"]


class Spectra(eqx.Module):
    r"""Spectra over depth, returned by [`spectra`][itde.analysis.spectra]: arrays indexed
    `[depth, head, k]` (attention) and `[depth, k]` (feed-forward).

    - `ts`: the depths, `[depths]`.
    - `qk_eigenvalues`, `qk_singular_values`, `vo_eigenvalues`, `vo_singular_values`: as in
      [`HeadSpectra`][itde.analysis.HeadSpectra], with a leading depth axis.
    - `w1_singular_values`, `w2_singular_values`: the feed-forward's kernels,
      `[depths, min(d, d_ff)]`, decreasing.
    - `w1w2_eigenvalues`: the nonzero eigenvalues of $W_1 W_2$ (complex),
      `[depths, min(d, d_ff)]`, by decreasing modulus (see
      [`feedforward_eigenvalues`][itde.analysis.feedforward_eigenvalues]).
    - `w_gate_singular_values`: the gate's kernel of a gated feed-forward, or None.
    """

    ts: Float[Array, " depths"]
    qk_eigenvalues: Complex[Array, "depths heads k"]
    qk_singular_values: Float[Array, "depths heads k"]
    vo_eigenvalues: Complex[Array, "depths heads kv"]
    vo_singular_values: Float[Array, "depths heads kv"]
    w1_singular_values: Float[Array, "depths k"]
    w2_singular_values: Float[Array, "depths k"]
    w1w2_eigenvalues: Complex[Array, "depths k"]
    w_gate_singular_values: Float[Array, "depths k"] | None = None


def _sqrt_weights(w, n: int, name: str, dtype):
    """$\\sqrt{w}$ as an array of the kernels' dtype, or None for unit weights."""
    if w is None:
        return None
    w = np.asarray(w, dtype=np.float64)
    if w.shape != (n,):
        raise ValueError(f"`{name}` must have shape ({n},), got {w.shape}.")
    if not np.all(w > 0):
        raise ValueError(f"`{name}` must be positive quadrature weights, got {w}.")
    return jnp.asarray(np.sqrt(w), dtype)


def _scale(a, left, right):
    """`diag(left) @ a @ diag(right)` over the last two axes (None: no scaling)."""
    if left is not None:
        a = a * left[:, None]
    if right is not None:
        a = a * right
    return a


def _sorted_eigenvalues(lam):
    """Decreasing modulus; of equal moduli (a conjugate pair), positive imaginary first."""
    order = jnp.lexsort((-lam.imag, -jnp.abs(lam)), axis=-1)
    return jnp.take_along_axis(lam, order, axis=-1)


def _product_spectrum(a, b):
    r"""Eigenvalues and singular values of $a\,b^\top$ for `a`, `b` `[..., d, e]`: the
    $k = \min(d, e)$ that can be nonzero, through $k \times k$ matrices (one pair of
    matrices at a time, see `_one_at_a_time`)."""
    return _one_at_a_time(_product_spectrum_one, a, b)


def _product_spectrum_one(a, b):
    d, e = a.shape[-2:]
    if e <= d:
        small = jnp.swapaxes(b, -1, -2) @ a  # [e, e], the nonzero eigenvalues of a b^T
        ra = jnp.linalg.qr(a, mode="r")
        rb = jnp.linalg.qr(b, mode="r")
        core = ra @ jnp.swapaxes(rb, -1, -2)
    else:
        small = core = a @ jnp.swapaxes(b, -1, -2)  # [d, d]
    lam = jnp.linalg.eigvals(small)
    sv = jnp.linalg.svd(core, compute_uv=False)
    return _sorted_eigenvalues(lam), sv


def head_spectra(
    attention: Attention,
    *,
    feature_weights: np.ndarray | None = None,
    head_weights: np.ndarray | None = None,
) -> HeadSpectra:
    r"""The spectra of every head of one discrete attention.

    **Arguments:**

    - `attention`: an [`Attention`][itde.Attention] (per-head `wq [h, d, e]`,
      `wk [h_kv, d, e]`, `wv [h_kv, d, e_v]`, `wo [h, e_v, d]`).
    - `feature_weights`: the feature quadrature weights $w$ (`None`: all 1).
    - `head_weights`: the head domain's weights $w_h$ (`None`: all 1), applied to both the
      query/key and the value/output contraction, as the operator applies them.

    **Returns:** a [`HeadSpectra`][itde.analysis.HeadSpectra]: the spectra of
    $D_w^{1/2} W^Q_m D_{w_h} {W^K_{g(m)}}^\top D_w^{1/2}$ and
    $D_w^{1/2} W^V_{g(m)} D_{w_h} W^O_m D_w^{1/2}$ (see the module's note).
    """
    if not isinstance(attention, Attention):
        raise TypeError(
            f"`attention` must be a discrete itde.Attention, got {type(attention).__name__}; "
            "for function kernels take `op.discretise(grid)` first (or call `spectra(model)`)."
        )
    dtype = jnp.result_type(attention.wq.dtype, jnp.float32)
    _, d, e = attention.wq.shape
    ev = attention.value_dim
    sw = _sqrt_weights(feature_weights, d, "feature_weights", dtype)
    if head_weights is not None and e != ev:
        raise ValueError(
            f"`head_weights` are one head domain's weights, but this attention's query size {e} "
            f"differs from its value size {ev}."
        )
    sh = _sqrt_weights(head_weights, e, "head_weights", dtype)
    ws = (attention.wq, attention.wk, attention.wv, attention.wo)
    return _head_spectra(*(w.astype(dtype) for w in ws), sw, sh)


@jax.jit
def _head_spectra(wq, wk, wv, wo, sw, sh):
    # query head m reads key/value head m // rep (Hugging Face's repeat_kv)
    rep = wq.shape[0] // wk.shape[0]
    wk, wv = jnp.repeat(wk, rep, axis=0), jnp.repeat(wv, rep, axis=0)
    qk_lam, qk_sv = _product_spectrum(_scale(wq, sw, sh), _scale(wk, sw, sh))
    # C = W^V W^O = a b^T with a = D^{1/2} W^V D_h^{1/2}, b = D^{1/2} W^O^T D_h^{1/2}
    vo_lam, vo_sv = _product_spectrum(_scale(wv, sw, sh), _scale(jnp.swapaxes(wo, -1, -2), sw, sh))
    return HeadSpectra(qk_lam, qk_sv, vo_lam, vo_sv)


@jax.jit
def _singular_values(w, left, right):
    return _one_at_a_time(lambda x: jnp.linalg.svd(x, compute_uv=False), _scale(w, left, right))


def feedforward_singular_values(
    feedforward,
    *,
    feature_weights: np.ndarray | None = None,
    hidden_weights: np.ndarray | None = None,
) -> dict[str, Array]:
    r"""The singular values of a discrete feed-forward's kernels, by name.

    `{"w1": ..., "w2": ...}` (and `"w_gate"` for a
    [`GatedFeedForward`][itde.GatedFeedForward]), each decreasing, of
    $D_w^{1/2} W_1 D_{w_z}^{1/2}$, $D_{w_z}^{1/2} W_2 D_w^{1/2}$ and
    $D_w^{1/2} W_\mathrm{gate} D_{w_z}^{1/2}$, with $w$ the feature weights and $w_z$ the
    hidden weights (`None`: all 1).
    """
    w1, dtype, sw, sz = _feedforward_kernel(feedforward, feature_weights, hidden_weights)
    out = {
        "w1": _singular_values(w1.astype(dtype), sw, sz),
        "w2": _singular_values(feedforward.w2.astype(dtype), sz, sw),
    }
    gate = getattr(feedforward, "w_gate", None)
    if gate is not None:
        out["w_gate"] = _singular_values(gate.astype(dtype), sw, sz)
    return out


def _feedforward_kernel(feedforward, feature_weights, hidden_weights):
    """A discrete feed-forward's `w1`, the dtype of its spectra and the square roots of
    its feature and hidden weights (a function kernel is refused by name)."""
    w1 = getattr(feedforward, "w1", None)
    if w1 is None or getattr(w1, "ndim", None) != 2:
        raise TypeError(
            "`feedforward` must be a discrete itde.FeedForward or GatedFeedForward (kernels "
            f"`w1 [d, d_ff]`, `w2 [d_ff, d]`), got {type(feedforward).__name__}; for function "
            "kernels take `op.discretise(grid)` first (or call `spectra(model)`)."
        )
    dtype = jnp.result_type(w1.dtype, jnp.float32)
    d, dff = w1.shape
    sw = _sqrt_weights(feature_weights, d, "feature_weights", dtype)
    sz = _sqrt_weights(hidden_weights, dff, "hidden_weights", dtype)
    return w1, dtype, sw, sz


@jax.jit
def _w1w2_eigenvalues(w1, w2, left, mid):
    # D^{1/2} W1 D_z W2 D^{1/2} = a b^T with a = D^{1/2} W1 D_z^{1/2}, b = D^{1/2} W2^T D_z^{1/2}
    lam, _ = _product_spectrum(_scale(w1, left, mid), _scale(jnp.swapaxes(w2, -1, -2), left, mid))
    return lam


def feedforward_eigenvalues(
    feedforward,
    *,
    feature_weights: np.ndarray | None = None,
    hidden_weights: np.ndarray | None = None,
) -> Array:
    r"""The nonzero eigenvalues of a discrete feed-forward's kernel product $W_1 W_2$.

    $W_1$ `[d, d_ff]` and $W_2$ `[d_ff, d]` (a [`FeedForward`][itde.FeedForward]'s
    `w1`, `w2`; a [`GatedFeedForward`][itde.GatedFeedForward]'s up and down kernels, the
    gate left out): the $\min(d, d_\mathrm{ff})$ eigenvalues of the $d \times d$ matrix
    $D_w^{1/2} W_1 D_{w_z} W_2 D_w^{1/2}$ that can be nonzero ($w$ the feature weights,
    $w_z$ the hidden weights; `None`: all 1, the plain $W_1 W_2$), complex, by decreasing
    modulus (of a conjugate pair, the positive imaginary part first). Tong et al.'s
    feed-forward spectrum (`qkvflow/analysis/spectral.py`, `examine_FF_spectra_info`: the
    eigenvalues of GPT-2's `c_fc.weight @ c_proj.weight`).
    """
    w1, dtype, sw, sz = _feedforward_kernel(feedforward, feature_weights, hidden_weights)
    return _w1w2_eigenvalues(w1.astype(dtype), feedforward.w2.astype(dtype), sw, sz)


def _depths(eq: TransformerIDE, ts) -> np.ndarray | Array:
    if ts is None:
        if not isinstance(eq.controls, PiecewiseConstant):
            raise ValueError(
                f"`ts`=None means every layer, but this model's controls "
                f"({type(eq.controls).__name__}) are smooth in depth and have no layers; give "
                f"the depths, e.g. ts=numpy.linspace({eq.controls.t0}, {eq.controls.t1}, 17)."
            )
        return np.asarray(eq.controls.layer_times()[:-1])
    ts = jnp.asarray(ts)
    if ts.ndim != 1 or ts.shape[0] == 0:
        raise ValueError(f"`ts` must be a non-empty 1-D array of depths, got shape {ts.shape}.")
    return ts


@eqx.filter_jit
def _spectra_at(eq: TransformerIDE, ts):
    fw = eq.feature_weights()

    def one(t):
        att, hw = eq.controls(t, "right", "attention").discretise(eq.grid)
        ff, zw = eq.controls(t, "right", "feedforward").discretise(eq.grid)
        hs = head_spectra(att, feature_weights=fw, head_weights=hw)
        fs = feedforward_singular_values(ff, feature_weights=fw, hidden_weights=zw)
        fs["w1w2"] = feedforward_eigenvalues(ff, feature_weights=fw, hidden_weights=zw)
        return hs, fs

    return jax.lax.map(one, ts)  # one depth at a time: no batched LAPACK call (_one_at_a_time)


def spectra(model, ts=None) -> Spectra:
    r"""The spectra of every head and of the feed-forward over depth.

    At depth $t$ the operators are those the equation applies at $t$
    (`controls(t, "right", ...)`, the layer a vector field starting at $t$ reads), sampled on
    the model's grid ([`discretise`][itde.AbstractAttention.discretise]) and weighted by its
    feature, head and hidden quadrature weights (see the module's note: the spectra of the
    integral operators, which on the unit grid are the plain matrices').

    **Arguments:**

    - `model`: an [`itde.TransformerIDE`][itde.TransformerIDE], or a model that holds one
      (an [`HFTransformer`][itde.interop.HFTransformer] from
      [`itde.from_hf`][itde.interop.from_hf], an [`HFCausalLM`][itde.interop.HFCausalLM], a
      trained model).
    - `ts`: the depths, a 1-D array. `None` (per-layer controls only): every layer, at the
      depth where it starts ($t_0, \dots, t_{L-1}$). Smooth controls
      ([`LegendreControls`][itde.LegendreControls],
      [`SplineControls`][itde.SplineControls]) take any depths, between layers too.

    **Returns:** a [`Spectra`][itde.analysis.Spectra] of arrays `[depth, head, k]` (the
    attention's) and `[depth, k]` (the feed-forward's: its kernels' singular values and
    the eigenvalues of $W_1 W_2$). One compiled computation for all
    depths, which with the heads are taken one at a time (`jax.lax.map`): jaxlib's batched
    LAPACK kernels can deadlock on a two-thread CPU at a real model's size.
    """
    eq = equation_of(model)
    depths = _depths(eq, ts)
    ts_arr = jnp.asarray(depths, dtype=jnp.result_type(float))
    hs, fs = _spectra_at(eq, ts_arr)
    return Spectra(
        ts=ts_arr,
        qk_eigenvalues=hs.qk_eigenvalues,
        qk_singular_values=hs.qk_singular_values,
        vo_eigenvalues=hs.vo_eigenvalues,
        vo_singular_values=hs.vo_singular_values,
        w1_singular_values=fs["w1"],
        w2_singular_values=fs["w2"],
        w1w2_eigenvalues=fs["w1w2"],
        w_gate_singular_values=fs.get("w_gate"),
    )


class LeadingSpectra(eqx.Module):
    r"""The leading values of [`Spectra`][itde.analysis.Spectra] at each depth, what
    [`analyze`][itde.analysis.analyze] reports: `qk_max_abs_eigenvalue`,
    `qk_spectral_norm`, `vo_spectral_norm` `[depths, heads]`, `w1_spectral_norm`,
    `w2_spectral_norm`, `w1w2_max_abs_eigenvalue` `[depths]`."""

    qk_max_abs_eigenvalue: Float[Array, "depths heads"]
    qk_spectral_norm: Float[Array, "depths heads"]
    vo_spectral_norm: Float[Array, "depths heads"]
    w1_spectral_norm: Float[Array, " depths"]
    w2_spectral_norm: Float[Array, " depths"]
    w1w2_max_abs_eigenvalue: Float[Array, " depths"]


def _product_norm(a, b):
    r"""$\|a b^\top\|_2$ for `a`, `b` `[d, e]`, from $e \times e$ symmetric eigenproblems
    only (no QR of the tall factors, no SVD): with $G_a = a^\top a = H H^\top$
    ($H = V \Lambda^{1/2}$ from the eigendecomposition of $G_a$), the nonzero eigenvalues of
    $(a b^\top)(a b^\top)^\top = a\, G_b\, a^\top$ are those of $H^\top G_b H$, symmetric
    and positive semidefinite; its largest is $\|a b^\top\|_2^2$, to a relative error of
    the order of the dtype's epsilon (Weyl). For $e > d$ the $d \times d$ product's Gram
    matrix is used directly."""
    d, e = a.shape[-2:]
    if e > d:
        c = a @ jnp.swapaxes(b, -1, -2)
        top = jnp.linalg.eigvalsh(c @ c.T)[-1]
    else:
        lam, v = jnp.linalg.eigh(a.T @ a)
        h = v * jnp.sqrt(jnp.maximum(lam, 0))
        top = jnp.linalg.eigvalsh(h.T @ (b.T @ b) @ h)[-1]
    return jnp.sqrt(jnp.maximum(top, 0))


def _plain_norm(w):
    r"""$\|w\|_2$ as the square root of the largest eigenvalue of the smaller Gram matrix
    ($w w^\top$ or $w^\top w$, symmetric: LAPACK's `syevd`, no SVD of the wide kernel)."""
    g = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w
    return jnp.sqrt(jnp.maximum(jnp.linalg.eigvalsh(g)[-1], 0))


@eqx.filter_jit
def _leading_at(eq: TransformerIDE, ts):
    fw = eq.feature_weights()

    def one(t):
        att, hw = eq.controls(t, "right", "attention").discretise(eq.grid)
        ff, zw = eq.controls(t, "right", "feedforward").discretise(eq.grid)
        dtype = jnp.result_type(att.wq.dtype, jnp.float32)
        d, e = att.wq.shape[1:]
        sw = _sqrt_weights_traced(fw, dtype)
        sh = _sqrt_weights_traced(hw, dtype)
        rep = att.wq.shape[0] // att.wk.shape[0]
        wk, wv = (jnp.repeat(w.astype(dtype), rep, axis=0) for w in (att.wk, att.wv))
        qa, qb = _scale(att.wq.astype(dtype), sw, sh), _scale(wk, sw, sh)
        va, vb = _scale(wv, sw, sh), _scale(jnp.swapaxes(att.wo.astype(dtype), -1, -2), sw, sh)
        # the nonzero eigenvalues of a b^T are those of b^T a (e x e: small, one per head)
        small = jnp.swapaxes(qb, -1, -2) @ qa if e <= d else qa @ jnp.swapaxes(qb, -1, -2)
        qk_eig = jnp.max(jnp.abs(jax.lax.map(jnp.linalg.eigvals, small)), axis=-1)
        qk = _one_at_a_time(_product_norm, qa, qb)
        vo = _one_at_a_time(_product_norm, va, vb)
        sz = _sqrt_weights_traced(zw, dtype)
        w1, w2 = ff.w1.astype(dtype), ff.w2.astype(dtype)
        n1, n2 = _plain_norm(_scale(w1, sw, sz)), _plain_norm(_scale(w2, sz, sw))
        fa, fb = _scale(w1, sw, sz), _scale(jnp.swapaxes(w2, -1, -2), sw, sz)
        ff_small = fb.T @ fa if fa.shape[1] <= fa.shape[0] else fa @ fb.T
        return qk_eig, qk, vo, n1, n2, jnp.max(jnp.abs(jnp.linalg.eigvals(ff_small)))

    return jax.lax.map(one, ts)  # one depth at a time: LAPACK calls never batched


def _sqrt_weights_traced(w, dtype):
    return None if w is None else jnp.sqrt(jnp.asarray(w, dtype))


def leading_spectra(model, ts=None) -> LeadingSpectra:
    r"""The leading values of [`spectra`][itde.analysis.spectra] (same arguments): each
    head's largest eigenvalue modulus and spectral norm of $W^Q {W^K}^\top$, the spectral
    norm of $W^V W^O$, those of the feed-forward's kernels and the largest eigenvalue
    modulus of $W_1 W_2$, at each depth: what [`analyze`][itde.analysis.analyze] reports.

    **Why.** `spectra` takes every singular value (LAPACK's SVD of each $d \times d_\mathrm{ff}$
    kernel) and runs the depths' and heads' decompositions as batched LAPACK calls, which
    XLA's CPU runtime may run side by side on its thread pool; jaxlib's batched LAPACK
    kernels then wait on each other (a hang observed at SmolLM2's size on two cores).
    Here every decomposition is of one small matrix at a time: the heads' spectral norms
    from $e \times e$ symmetric eigenproblems (no QR of the $d \times e$ factors, no SVD),
    the kernels' from the largest eigenvalue of their smaller Gram matrix, the depths one
    after another (SmolLM2-135M's 30 layers: 9-12 s on an idle 2-core CPU). (Power iterations on
    matrix products, used before, took minutes at SmolLM2's size: their top singular
    values are close, and 1000 iterations a norm ran at every depth.)
    """
    eq = equation_of(model)
    depths = _depths(eq, ts)
    out = _leading_at(eq, jnp.asarray(depths, dtype=jnp.result_type(float)))
    return LeadingSpectra(*out)
