"""The training loss and optimiser against independent computations: the cross-entropy
against PyTorch's, and `make_optimizer` against AdamW written out in NumPy (global-norm
clipping, linear warm-up then cosine decay, weight decay on kernels only, the redundant
constraint-set scalars frozen).

The gradient and resume tests elsewhere compare the training step with itself (finite
differences of the same loss, a resumed run against an uninterrupted one), so a wrong
normalisation axis, clipping rule, schedule or decay mask passes them."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

import itde
from itde._internal import kernel
from itde.train import OptimConfig, make_optimizer
from itde.train._internal import cross_entropy


def test_cross_entropy_is_torchs_mean_over_every_position():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 7)) * 2.0  # [batch, tokens, vocab]
    targets = rng.integers(0, 7, size=(3, 5))
    ref = F.cross_entropy(torch.as_tensor(logits).reshape(-1, 7),
                          torch.as_tensor(targets).reshape(-1))  # fmt: skip
    got = cross_entropy(jnp.asarray(logits), jnp.asarray(targets))
    np.testing.assert_allclose(float(got), float(ref), rtol=1e-13)


class _Params(eqx.Module):
    w1: jax.Array = kernel()  # a kernel (declared where it is defined): decayed
    b1: jax.Array  # a bias: not decayed
    norm: itde.LayerNormProjection  # gain and shift trained; sigma1, sigma2 frozen


def _lr(t, o):
    """Linear warm-up from 0 to lr over `warmup` steps, then cosine decay to
    lr * final_lr_ratio at `steps` (the documented schedule)."""
    if t < o.warmup:
        return o.lr * t / o.warmup
    end = o.lr * o.final_lr_ratio
    frac = min(t - o.warmup, o.steps - o.warmup) / (o.steps - o.warmup)
    return end + (o.lr - end) * 0.5 * (1 + np.cos(np.pi * frac))


def test_make_optimizer_is_clipped_adamw_on_the_schedule_with_the_decay_mask():
    o = OptimConfig(lr=0.1, warmup=3, final_lr_ratio=0.2, weight_decay=0.5, b1=0.8, b2=0.95,
                    clip_norm=0.5, steps=8)  # fmt: skip
    rng = np.random.default_rng(1)
    params = _Params(
        jnp.asarray(rng.normal(size=(3, 2))),
        jnp.asarray(rng.normal(size=2)),
        itde.LayerNormProjection(0.1, 1.2, jnp.asarray(rng.normal(size=2)),
                                 jnp.asarray(rng.normal(size=2)), eps=1e-5),
    )  # fmt: skip
    opt = make_optimizer(o)
    state = opt.init(params)
    names = ("w1", "b1", "gain", "shift", "sigma1", "sigma2")
    get = lambda p: [p.w1, p.b1, p.norm.gain, p.norm.shift, p.norm.sigma1, p.norm.sigma2]  # noqa: E731
    ref = [np.asarray(a, np.float64) for a in get(params)]
    decayed = [True, False, False, False, False, False]
    trained = [True, True, True, True, False, False]
    mu = [np.zeros_like(a) for a in ref]
    nu = [np.zeros_like(a) for a in ref]
    for t in range(o.steps):
        g = [rng.normal(size=np.shape(a)) * 3.0 for a in ref]
        grads = eqx.tree_at(get, params, [jnp.asarray(x) for x in g])
        updates, state = opt.update(grads, state, params)
        params = eqx.apply_updates(params, updates)
        # the reference: clip the trained leaves by their global norm, then AdamW
        norm = np.sqrt(sum(np.sum(x**2) for x, tr in zip(g, trained) if tr))
        scale = min(1.0, o.clip_norm / norm)
        for i in range(len(ref)):
            if not trained[i]:
                continue
            gi = g[i] * scale
            mu[i] = o.b1 * mu[i] + (1 - o.b1) * gi
            nu[i] = o.b2 * nu[i] + (1 - o.b2) * gi**2
            m_hat, v_hat = mu[i] / (1 - o.b1 ** (t + 1)), nu[i] / (1 - o.b2 ** (t + 1))
            step = m_hat / (np.sqrt(v_hat) + 1e-8)
            if decayed[i]:
                step = step + o.weight_decay * ref[i]
            ref[i] = ref[i] - _lr(t, o) * step
        # optax evaluates the schedule in float32: agreement to its round-off (a wrong
        # clipping rule, decay mask or schedule moves the parameters by >= 1e-4)
        for name, got, want in zip(names, get(params), ref):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-9,
                                       err_msg=f"{name} after step {t}")  # fmt: skip
