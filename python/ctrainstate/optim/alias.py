"""Optimizers with optax's names, arguments, defaults and state structure.

>>> import numpy as np, ctrainstate.optim as optim
>>> tx = optim.adamw(1e-3, weight_decay=0.01)
>>> [type(s).__name__ for s in tx.init({'w': np.zeros(2, np.float32)})]
['ScaleByAdamState', 'EmptyState', 'EmptyState']
"""
from __future__ import annotations

import numpy as np

from .base import identity
from .combine import chain
from .combine import masked
from .transforms import (add_decayed_weights, scale_by_sign, clip_by_block_rms, ema, scale,
                         add_noise, scale_by_adam, scale_by_adamax, scale_by_amsgrad,
                         scale_by_stddev, scale_by_belief, scale_by_radam, scale_by_yogi, scale_by_factored_rms, scale_by_learning_rate,
                         scale_by_lion, scale_by_param_block_rms, scale_by_rms, scale_by_rss,
                         scale_by_trust_ratio, trace, scale_by_adadelta, scale_by_adan,
                         scale_by_novograd, scale_by_optimistic_gradient, scale_by_rprop)

__all__ = ["sgd", "adam", "adamw", "lion", "rmsprop", "adagrad", "lamb", "adafactor",
           "adabelief", "yogi", "radam", "fromage", "lars", "noisy_sgd", "adamax",
           "amsgrad", "nadam", "nadamw", "adamaxw", "sign_sgd", "signum"]


def sgd(learning_rate, momentum=None, nesterov=False, accumulator_dtype=None):
    """SGD with optional (Nesterov) momentum: chain(trace | identity, scale_by_learning_rate)."""
    opt = trace(decay=momentum, nesterov=nesterov, accumulator_dtype=accumulator_dtype) \
        if momentum is not None else identity()
    return chain(opt, scale_by_learning_rate(learning_rate))


def adam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None, *,
         nesterov=False):
    """Adam: chain(scale_by_adam, scale_by_learning_rate)."""
    return chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                 scale_by_learning_rate(learning_rate))


def adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None,
          weight_decay=1e-4, mask=None, *, nesterov=False):
    """AdamW: chain(scale_by_adam, add_decayed_weights(weight_decay, mask), scale_by_learning_rate).
    Fused: 28 bytes per fp32 parameter per step."""
    return chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                 add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(learning_rate))


def lion(learning_rate, b1=0.9, b2=0.99, mu_dtype=None, weight_decay=1e-3, mask=None):
    """Lion: chain(scale_by_lion, add_decayed_weights, scale_by_learning_rate)."""
    return chain(scale_by_lion(b1, b2, mu_dtype), add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(learning_rate))


def rmsprop(learning_rate, decay=0.9, eps=1e-8, initial_scale=0.0, eps_in_sqrt=True,
            centered=False, momentum=None, nesterov=False, bias_correction=False):
    """RMSProp: chain(scale_by_rms | scale_by_stddev (centered), scale_by_learning_rate,
    trace | identity). Fused."""
    scaling = scale_by_stddev if centered else scale_by_rms
    return chain(scaling(decay, eps, initial_scale, eps_in_sqrt, bias_correction),
                 scale_by_learning_rate(learning_rate),
                 trace(decay=momentum, nesterov=nesterov) if momentum is not None else identity())


def adagrad(learning_rate, initial_accumulator_value=0.1, eps=1e-7):
    """Adagrad: chain(scale_by_rss, scale_by_learning_rate)."""
    return chain(scale_by_rss(initial_accumulator_value, eps), scale_by_learning_rate(learning_rate))


def lamb(learning_rate, b1=0.9, b2=0.999, eps=1e-6, eps_root=0.0, weight_decay=0.0, mask=None):
    """LAMB: chain(scale_by_adam, add_decayed_weights, scale_by_trust_ratio,
    scale_by_learning_rate). Fused, with one extra read pass for the per-leaf norms."""
    return chain(scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root),
                 add_decayed_weights(weight_decay=weight_decay, mask=mask),
                 scale_by_trust_ratio(), scale_by_learning_rate(learning_rate))


def adafactor(learning_rate=None, min_dim_size_to_factor=128, decay_rate=0.8, decay_offset=0,
              multiply_by_parameter_scale=True, clipping_threshold=1.0, momentum=None,
              dtype_momentum=np.float32, weight_decay_rate=None, eps=1e-30, factored=True,
              weight_decay_mask=None):
    """Adafactor (optax.adafactor) with factored second moments. Fused: the statistics are
    read-only passes on the devices (see scale_by_factored_rms). As optax, the momentum (when
    ``momentum`` is set) is kept in ``dtype_momentum`` (float32 by default, whatever the
    params' dtype) and the factored statistics in the params' dtype."""
    tx = [scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor, eps)]
    if clipping_threshold is not None:
        tx.append(clip_by_block_rms(clipping_threshold))
    if learning_rate is not None:
        tx.append(scale_by_learning_rate(learning_rate, flip_sign=False))
    if multiply_by_parameter_scale:
        tx.append(scale_by_param_block_rms())
    if momentum is not None:
        tx.append(ema(momentum, debias=False, accumulator_dtype=dtype_momentum))
    if weight_decay_rate is not None:
        tx.append(add_decayed_weights(weight_decay_rate, mask=weight_decay_mask))
    tx.append(scale(-1))
    return chain(*tx)


def adabelief(learning_rate, b1=0.9, b2=0.999, eps=1e-16, eps_root=1e-16, *, nesterov=False):
    """AdaBelief: chain(scale_by_belief, scale_by_learning_rate). Fused."""
    return chain(scale_by_belief(b1=b1, b2=b2, eps=eps, eps_root=eps_root, nesterov=nesterov),
                 scale_by_learning_rate(learning_rate))


def yogi(learning_rate, b1=0.9, b2=0.999, eps=1e-3):
    """Yogi: chain(scale_by_yogi, scale_by_learning_rate). Fused."""
    return chain(scale_by_yogi(b1=b1, b2=b2, eps=eps), scale_by_learning_rate(learning_rate))


def radam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, threshold=5.0, *,
          nesterov=False):
    """Rectified Adam: chain(scale_by_radam, scale_by_learning_rate). Fused."""
    return chain(scale_by_radam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, threshold=threshold,
                                nesterov=nesterov),
                 scale_by_learning_rate(learning_rate))


def fromage(learning_rate, min_norm=1e-6):
    """Fromage: chain(scale_by_trust_ratio(min_norm), scale_by_learning_rate(lr * m),
    add_decayed_weights(m - 1)) with m = 1 / sqrt(1 + lr^2) (a schedule gives per-step m).
    Fused, with the trust ratio's read-only norm pass."""
    if not callable(learning_rate):
        mult = 1 / (1 + learning_rate ** 2) ** 0.5
        return chain(scale_by_trust_ratio(min_norm),
                     scale_by_learning_rate(learning_rate * mult),
                     add_decayed_weights(mult - 1))

    def mult_lr(count):
        return 1 / (1 + learning_rate(count) ** 2) ** 0.5
    return chain(scale_by_trust_ratio(min_norm),
                 scale_by_learning_rate(lambda c: mult_lr(c) * learning_rate(c)),
                 add_decayed_weights(lambda c: mult_lr(c) - 1))


def lars(learning_rate, weight_decay=0.0, weight_decay_mask=True, trust_coefficient=0.001,
         eps=0.0, trust_ratio_mask=True, momentum=0.9, nesterov=False):
    """LARS: chain(add_decayed_weights(mask), masked(scale_by_trust_ratio), scale_by_learning_rate,
    trace). Fused."""
    return chain(add_decayed_weights(weight_decay, mask=weight_decay_mask),
                 masked(scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps),
                        trust_ratio_mask),
                 scale_by_learning_rate(learning_rate),
                 trace(decay=momentum, nesterov=nesterov))


def noisy_sgd(learning_rate, eta=0.01, gamma=0.55, key=None, *, seed=None):
    """Noisy SGD: chain(add_noise(eta, gamma, key), scale_by_learning_rate). The noise is
    jax.random's, bit for bit, drawn shard by shard (see add_noise); the step is not fused."""
    return chain(add_noise(eta, gamma, key, seed=seed), scale_by_learning_rate(learning_rate))


def adamax(learning_rate, b1=0.9, b2=0.999, eps=1e-8):
    """Adamax: chain(scale_by_adamax, scale_by_learning_rate). Fused."""
    return chain(scale_by_adamax(b1=b1, b2=b2, eps=eps), scale_by_learning_rate(learning_rate))


def amsgrad(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None,
            bias_correction_mu=True, bias_correction_nu=True):
    """AMSGrad: chain(scale_by_amsgrad, scale_by_learning_rate). Fused."""
    return chain(scale_by_amsgrad(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
                                  bias_correction_mu=bias_correction_mu,
                                  bias_correction_nu=bias_correction_nu),
                 scale_by_learning_rate(learning_rate))


def nadam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None, *,
          nesterov=True):
    """NAdam (optax.nadam, ``functools.partial(adam, nesterov=True)``): Adam with Nesterov
    momentum. Fused."""
    return adam(learning_rate, b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov)


def nadamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, mu_dtype=None,
           weight_decay=1e-4, mask=None, *, nesterov=True):
    """NAdamW (optax.nadamw, ``functools.partial(adamw, nesterov=True)``): AdamW with
    Nesterov momentum. Fused."""
    return adamw(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask,
                 nesterov=nesterov)


def adamaxw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4, mask=None):
    """AdamaxW (optax.adamaxw): chain(scale_by_adamax, add_decayed_weights(weight_decay,
    mask), scale_by_learning_rate). Fused."""
    return chain(scale_by_adamax(b1=b1, b2=b2, eps=eps),
                 add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(learning_rate))


def sign_sgd(learning_rate):
    """SignSGD (optax.sign_sgd): chain(scale_by_sign, scale_by_learning_rate). Not fused (the
    sign is an elementwise op per leaf; the scaling a fused pass)."""
    return chain(scale_by_sign(), scale_by_learning_rate(learning_rate))


def signum(learning_rate, beta=0.9, accumulator_dtype=None):
    """Signum (optax.signum): chain(ema(beta, debias=False, accumulator_dtype),
    scale_by_sign, scale_by_learning_rate): the sign of the momentum. Not fused as a whole
    (the sign runs between the fused ema and scaling passes)."""
    return chain(ema(beta, debias=False, accumulator_dtype=accumulator_dtype), scale_by_sign(),
                 scale_by_learning_rate(learning_rate))


def adadelta(learning_rate=None, rho=0.9, eps=1e-6, weight_decay=0.0, weight_decay_mask=None):
    """Adadelta (optax.adadelta): chain(add_decayed_weights(weight_decay, weight_decay_mask),
    scale_by_adadelta(rho, eps), scale_by_learning_rate(learning_rate)). optax's default
    ``learning_rate=None`` fails there with a TypeError about ``-1 * None``; here it raises
    a ValueError asking for a learning rate (1.0 is Adadelta's unit step). Not fused."""
    if learning_rate is None:
        raise ValueError("adadelta: learning_rate=None (optax's default) cannot be used; give "
                         "a learning rate or schedule (1.0 is the paper's unit step)")
    return chain(add_decayed_weights(weight_decay, mask=weight_decay_mask),
                 scale_by_adadelta(rho=rho, eps=eps),
                 scale_by_learning_rate(learning_rate))


def novograd(learning_rate, b1=0.9, b2=0.25, eps=1e-6, eps_root=0.0, weight_decay=0.0):
    """NovoGrad (optax.novograd): chain(scale_by_novograd, scale_by_learning_rate). Not
    fused; needs params."""
    return chain(scale_by_novograd(b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                                   weight_decay=weight_decay),
                 scale_by_learning_rate(learning_rate))


def rprop(learning_rate, eta_minus=0.5, eta_plus=1.2, min_step_size=1e-6, max_step_size=50.0):
    """Rprop (optax.rprop): chain(scale_by_rprop, scale(-1.0)). ``learning_rate`` is the
    initial step size, a fixed number. Not fused."""
    return chain(scale_by_rprop(learning_rate=learning_rate, eta_minus=eta_minus,
                                eta_plus=eta_plus, min_step_size=min_step_size,
                                max_step_size=max_step_size),
                 scale(-1.0))


def adan(learning_rate, b1=0.98, b2=0.92, b3=0.99, eps=1e-8, eps_root=1e-8, weight_decay=0.0,
         mask=None):
    """Adan (optax.adan): chain(scale_by_adan, add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate). Not fused."""
    return chain(scale_by_adan(b1=b1, b2=b2, b3=b3, eps=eps, eps_root=eps_root),
                 add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(learning_rate))


def optimistic_gradient_descent(learning_rate, alpha=1.0, beta=1.0):
    """Optimistic gradient descent (optax.optimistic_gradient_descent):
    chain(scale_by_optimistic_gradient(alpha, beta), scale_by_learning_rate). Not fused."""
    return chain(scale_by_optimistic_gradient(alpha=alpha, beta=beta),
                 scale_by_learning_rate(learning_rate))


def optimistic_adam(learning_rate, optimism=None, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
                    mu_dtype=None, *, nesterov=True):
    """Optimistic Adam (optax.optimistic_adam, deprecated there in favour of
    optimistic_adam_v2, and so warning here too): chain(scale_by_adam(..., nesterov),
    scale_by_optimistic_gradient(alpha=learning_rate, beta=optimism or learning_rate),
    scale_by_learning_rate(1.0)). ``learning_rate`` must be a number (optax's ValueError)."""
    import warnings
    warnings.warn("`optimistic_adam` is deprecated, please use `optimistic_adam_v2` instead.",
                  category=DeprecationWarning, stacklevel=2)
    if callable(learning_rate):
        raise ValueError("This version of `optimistic_adam` does not support learning rate "
                         "schedules but `optimistic_adam_v2` does.")
    if optimism is None:
        optimism = learning_rate
    return chain(scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
                               nesterov=nesterov),
                 scale_by_optimistic_gradient(alpha=learning_rate, beta=optimism),
                 scale_by_learning_rate(1.0))


__all__ += ["adadelta", "novograd", "rprop", "adan", "optimistic_gradient_descent",
            "optimistic_adam"]
