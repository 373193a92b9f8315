"""The implementation of :mod:`ctrainstate.optim.alias` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import warnings
from typing import Any, Callable

import numpy as np

from .base import GradientTransformationExtraArgs, identity
from .combine import chain
from .combine import masked
from .transforms import (add_decayed_weights, scale_by_sign, clip_by_block_rms, ema, scale,
                         add_noise, scale_by_adam, scale_by_adamax, scale_by_amsgrad,
                         scale_by_stddev, scale_by_belief, scale_by_radam, scale_by_yogi, scale_by_factored_rms, scale_by_learning_rate,
                         scale_by_lion, scale_by_param_block_rms, scale_by_rms, scale_by_rss,
                         scale_by_trust_ratio, trace, scale_by_adadelta, scale_by_adan,
                         scale_by_novograd, scale_by_optimistic_gradient, scale_by_rprop)
from .transforms import _check_number, _check_scalar
from .utils import ScalarOrSchedule

# a mask: a tree of bools like the params (or a prefix of it), or a function params -> one
MaskOrFn = Any | Callable[[Any], Any] | None

def _check_optional_numbers(who, **hyper) -> None:
    """Check an optimizer's own numeric arguments (those its transforms know by another
    name, or that are optional) when it is built: TypeError naming the argument."""
    for name, value in hyper.items():
        if value is not None:
            _check_number(value, f"{who}: {name}")


__all__ = ["sgd", "adam", "adamw", "lion", "rmsprop", "adagrad", "lamb", "adafactor",
           "adabelief", "yogi", "radam", "fromage", "lars", "noisy_sgd", "adamax",
           "amsgrad", "nadam", "nadamw", "adamaxw", "sign_sgd", "signum"]


def sgd(learning_rate: ScalarOrSchedule, momentum: float | None = None, nesterov: bool = False,
        accumulator_dtype: Any | None = None) -> GradientTransformationExtraArgs:
    """SGD with optional (Nesterov) momentum: chain(trace | identity, scale_by_learning_rate)."""
    _check_optional_numbers("sgd", momentum=momentum)
    opt = trace(decay=momentum, nesterov=nesterov, accumulator_dtype=accumulator_dtype) \
        if momentum is not None else identity()
    return chain(opt, scale_by_learning_rate(learning_rate))


def adam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
        eps_root: float = 0.0, mu_dtype: Any | None = None, *,
        nesterov: bool = False) -> GradientTransformationExtraArgs:
    """Adam: chain(scale_by_adam, scale_by_learning_rate)."""
    return chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                 scale_by_learning_rate(learning_rate))


def adamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
        eps_root: float = 0.0, mu_dtype: Any | None = None, weight_decay: ScalarOrSchedule = 1e-4,
        mask: MaskOrFn = None, *, nesterov: bool = False) -> GradientTransformationExtraArgs:
    """AdamW: chain(scale_by_adam, add_decayed_weights(weight_decay, mask), scale_by_learning_rate).
    Fused: 28 bytes per fp32 parameter per step."""
    return chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                 add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(learning_rate))


def lion(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.99,
        mu_dtype: Any | None = None, weight_decay: ScalarOrSchedule = 1e-3,
        mask: MaskOrFn = None) -> GradientTransformationExtraArgs:
    """Lion: chain(scale_by_lion, add_decayed_weights, scale_by_learning_rate)."""
    return chain(scale_by_lion(b1, b2, mu_dtype), add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(learning_rate))


def rmsprop(learning_rate: ScalarOrSchedule, decay: float = 0.9, eps: float = 1e-8,
        initial_scale: float = 0.0, eps_in_sqrt: bool = True, centered: bool = False,
        momentum: float | None = None, nesterov: bool = False,
        bias_correction: bool = False) -> GradientTransformationExtraArgs:
    """RMSProp: chain(scale_by_rms | scale_by_stddev (centered), scale_by_learning_rate,
    trace | identity). Fused."""
    _check_optional_numbers("rmsprop", momentum=momentum)
    scaling = scale_by_stddev if centered else scale_by_rms
    return chain(scaling(decay, eps, initial_scale, eps_in_sqrt, bias_correction),
                 scale_by_learning_rate(learning_rate),
                 trace(decay=momentum, nesterov=nesterov) if momentum is not None else identity())


def adagrad(learning_rate: ScalarOrSchedule, initial_accumulator_value: float = 0.1,
        eps: float = 1e-7) -> GradientTransformationExtraArgs:
    """Adagrad: chain(scale_by_rss, scale_by_learning_rate)."""
    return chain(scale_by_rss(initial_accumulator_value, eps), scale_by_learning_rate(learning_rate))


def lamb(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
        eps_root: float = 0.0, weight_decay: ScalarOrSchedule = 0.0,
        mask: MaskOrFn = None) -> GradientTransformationExtraArgs:
    """LAMB: chain(scale_by_adam, add_decayed_weights, scale_by_trust_ratio,
    scale_by_learning_rate). Fused, with one extra read pass for the per-leaf norms."""
    return chain(scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root),
                 add_decayed_weights(weight_decay=weight_decay, mask=mask),
                 scale_by_trust_ratio(), scale_by_learning_rate(learning_rate))


def adafactor(learning_rate: ScalarOrSchedule | None = None, min_dim_size_to_factor: int = 128,
        decay_rate: float = 0.8, decay_offset: int = 0, multiply_by_parameter_scale: bool = True,
        clipping_threshold: float | None = 1.0, momentum: float | None = None,
        dtype_momentum: Any = np.float32, weight_decay_rate: float | None = None,
        eps: float = 1e-30, factored: bool = True,
        weight_decay_mask: MaskOrFn = None) -> GradientTransformationExtraArgs:
    """Adafactor (optax.adafactor) with factored second moments. Fused: the statistics are
    read-only passes on the devices (see scale_by_factored_rms). As optax, the momentum (when
    ``momentum`` is set) is kept in ``dtype_momentum`` (float32 by default, whatever the
    params' dtype) and the factored statistics in the params' dtype."""
    _check_optional_numbers("adafactor", decay_offset=decay_offset,
                            clipping_threshold=clipping_threshold, momentum=momentum,
                            weight_decay_rate=weight_decay_rate)
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


def adabelief(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
        eps: float = 1e-16, eps_root: float = 1e-16, *,
        nesterov: bool = False) -> GradientTransformationExtraArgs:
    """AdaBelief: chain(scale_by_belief, scale_by_learning_rate). Fused."""
    return chain(scale_by_belief(b1=b1, b2=b2, eps=eps, eps_root=eps_root, nesterov=nesterov),
                 scale_by_learning_rate(learning_rate))


def yogi(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
        eps: float = 1e-3) -> GradientTransformationExtraArgs:
    """Yogi: chain(scale_by_yogi, scale_by_learning_rate). Fused."""
    return chain(scale_by_yogi(b1=b1, b2=b2, eps=eps), scale_by_learning_rate(learning_rate))


def radam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
        eps_root: float = 0.0, threshold: float = 5.0, *,
        nesterov: bool = False) -> GradientTransformationExtraArgs:
    """Rectified Adam: chain(scale_by_radam, scale_by_learning_rate). Fused."""
    return chain(scale_by_radam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, threshold=threshold,
                                nesterov=nesterov),
                 scale_by_learning_rate(learning_rate))


def fromage(learning_rate: ScalarOrSchedule,
        min_norm: float = 1e-6) -> GradientTransformationExtraArgs:
    """Fromage: chain(scale_by_trust_ratio(min_norm), scale_by_learning_rate(lr * m),
    add_decayed_weights(m - 1)) with m = 1 / sqrt(1 + lr^2) (a schedule gives per-step m).
    Fused, with the trust ratio's read-only norm pass."""
    if not callable(learning_rate):
        _check_scalar(learning_rate, "fromage: learning_rate")
        mult = 1 / (1 + learning_rate ** 2) ** 0.5
        return chain(scale_by_trust_ratio(min_norm),
                     scale_by_learning_rate(learning_rate * mult),
                     add_decayed_weights(mult - 1))

    def mult_lr(count):
        return 1 / (1 + learning_rate(count) ** 2) ** 0.5
    return chain(scale_by_trust_ratio(min_norm),
                 scale_by_learning_rate(lambda c: mult_lr(c) * learning_rate(c)),
                 add_decayed_weights(lambda c: mult_lr(c) - 1))


def lars(learning_rate: ScalarOrSchedule, weight_decay: ScalarOrSchedule = 0.0,
        weight_decay_mask: MaskOrFn = True, trust_coefficient: float = 0.001, eps: float = 0.0,
        trust_ratio_mask: MaskOrFn = True, momentum: float | None = 0.9,
        nesterov: bool = False) -> GradientTransformationExtraArgs:
    """LARS: chain(add_decayed_weights(mask), masked(scale_by_trust_ratio), scale_by_learning_rate,
    trace). Fused."""
    _check_optional_numbers("lars", momentum=momentum)
    return chain(add_decayed_weights(weight_decay, mask=weight_decay_mask),
                 masked(scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps),
                        trust_ratio_mask),
                 scale_by_learning_rate(learning_rate),
                 trace(decay=momentum, nesterov=nesterov))


def noisy_sgd(learning_rate: ScalarOrSchedule, eta: float = 0.01, gamma: float = 0.55,
        key: Any | None = None, *, seed: int | None = None) -> GradientTransformationExtraArgs:
    """Noisy SGD: chain(add_noise(eta, gamma, key), scale_by_learning_rate). The noise is
    jax.random's, bit for bit, drawn shard by shard (see add_noise); the step is not fused."""
    return chain(add_noise(eta, gamma, key, seed=seed), scale_by_learning_rate(learning_rate))


def adamax(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
        eps: float = 1e-8) -> GradientTransformationExtraArgs:
    """Adamax: chain(scale_by_adamax, scale_by_learning_rate). Fused."""
    return chain(scale_by_adamax(b1=b1, b2=b2, eps=eps), scale_by_learning_rate(learning_rate))


def amsgrad(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
        eps_root: float = 0.0, mu_dtype: Any | None = None, bias_correction_mu: bool = True,
        bias_correction_nu: bool = True) -> GradientTransformationExtraArgs:
    """AMSGrad: chain(scale_by_amsgrad, scale_by_learning_rate). Fused."""
    return chain(scale_by_amsgrad(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
                                  bias_correction_mu=bias_correction_mu,
                                  bias_correction_nu=bias_correction_nu),
                 scale_by_learning_rate(learning_rate))


def nadam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
        eps_root: float = 0.0, mu_dtype: Any | None = None, *,
        nesterov: bool = True) -> GradientTransformationExtraArgs:
    """NAdam (optax.nadam, ``functools.partial(adam, nesterov=True)``): Adam with Nesterov
    momentum. Fused."""
    return adam(learning_rate, b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov)


def nadamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
        eps_root: float = 0.0, mu_dtype: Any | None = None, weight_decay: ScalarOrSchedule = 1e-4,
        mask: MaskOrFn = None, *, nesterov: bool = True) -> GradientTransformationExtraArgs:
    """NAdamW (optax.nadamw, ``functools.partial(adamw, nesterov=True)``): AdamW with
    Nesterov momentum. Fused."""
    return adamw(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask,
                 nesterov=nesterov)


def adamaxw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
        weight_decay: ScalarOrSchedule = 1e-4,
        mask: MaskOrFn = None) -> GradientTransformationExtraArgs:
    """AdamaxW (optax.adamaxw): chain(scale_by_adamax, add_decayed_weights(weight_decay,
    mask), scale_by_learning_rate). Fused."""
    return chain(scale_by_adamax(b1=b1, b2=b2, eps=eps),
                 add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(learning_rate))


def sign_sgd(learning_rate: ScalarOrSchedule) -> GradientTransformationExtraArgs:
    """SignSGD (optax.sign_sgd): chain(scale_by_sign, scale_by_learning_rate). Not fused (the
    sign is an elementwise op per leaf; the scaling a fused pass)."""
    return chain(scale_by_sign(), scale_by_learning_rate(learning_rate))


def signum(learning_rate: ScalarOrSchedule, beta: float = 0.9,
        accumulator_dtype: Any | None = None) -> GradientTransformationExtraArgs:
    """Signum (optax.signum): chain(ema(beta, debias=False, accumulator_dtype),
    scale_by_sign, scale_by_learning_rate): the sign of the momentum. Not fused as a whole
    (the sign runs between the fused ema and scaling passes)."""
    _check_optional_numbers("signum", beta=beta)
    return chain(ema(beta, debias=False, accumulator_dtype=accumulator_dtype), scale_by_sign(),
                 scale_by_learning_rate(learning_rate))


def adadelta(learning_rate: ScalarOrSchedule | None = None, rho: float = 0.9, eps: float = 1e-6,
        weight_decay: ScalarOrSchedule = 0.0,
        weight_decay_mask: MaskOrFn = None) -> GradientTransformationExtraArgs:
    """Adadelta (optax.adadelta): chain(add_decayed_weights(weight_decay, weight_decay_mask),
    scale_by_adadelta(rho, eps), scale_by_learning_rate(learning_rate)). With optax's default
    ``learning_rate=None`` the last transform is the identity (optax 0.2.8's
    scale_by_learning_rate(None)): the updates are Adadelta's scaled grads, not negated.
    Not fused."""
    return chain(add_decayed_weights(weight_decay, mask=weight_decay_mask),
                 scale_by_adadelta(rho=rho, eps=eps),
                 scale_by_learning_rate(learning_rate))


def novograd(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.25, eps: float = 1e-6,
        eps_root: float = 0.0,
        weight_decay: ScalarOrSchedule = 0.0) -> GradientTransformationExtraArgs:
    """NovoGrad (optax.novograd): chain(scale_by_novograd, scale_by_learning_rate). Not
    fused; needs params."""
    return chain(scale_by_novograd(b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                                   weight_decay=weight_decay),
                 scale_by_learning_rate(learning_rate))


def rprop(learning_rate: float, eta_minus: float = 0.5, eta_plus: float = 1.2,
        min_step_size: float = 1e-6,
        max_step_size: float = 50.0) -> GradientTransformationExtraArgs:
    """Rprop (optax.rprop): chain(scale_by_rprop, scale(-1.0)). ``learning_rate`` is the
    initial step size, a fixed number. Not fused."""
    return chain(scale_by_rprop(learning_rate=learning_rate, eta_minus=eta_minus,
                                eta_plus=eta_plus, min_step_size=min_step_size,
                                max_step_size=max_step_size),
                 scale(-1.0))


def adan(learning_rate: ScalarOrSchedule, b1: float = 0.98, b2: float = 0.92, b3: float = 0.99,
        eps: float = 1e-8, eps_root: float = 1e-8, weight_decay: ScalarOrSchedule = 0.0,
        mask: MaskOrFn = None) -> GradientTransformationExtraArgs:
    """Adan (optax.adan): chain(scale_by_adan, add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate). Not fused."""
    return chain(scale_by_adan(b1=b1, b2=b2, b3=b3, eps=eps, eps_root=eps_root),
                 add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(learning_rate))


def optimistic_gradient_descent(learning_rate: ScalarOrSchedule, alpha: float = 1.0,
        beta: float = 1.0) -> GradientTransformationExtraArgs:
    """Optimistic gradient descent (optax.optimistic_gradient_descent):
    chain(scale_by_optimistic_gradient(alpha, beta), scale_by_learning_rate). Not fused."""
    return chain(scale_by_optimistic_gradient(alpha=alpha, beta=beta),
                 scale_by_learning_rate(learning_rate))


def optimistic_adam(learning_rate: float, optimism: float | None = None,
        b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
        mu_dtype: Any | None = None, *, nesterov: bool = True) -> GradientTransformationExtraArgs:
    """Optimistic Adam (optax.optimistic_adam, deprecated there in favour of
    optimistic_adam_v2, and so warning here too): chain(scale_by_adam(..., nesterov),
    scale_by_optimistic_gradient(alpha=learning_rate, beta=optimism or learning_rate),
    scale_by_learning_rate(1.0)). ``learning_rate`` must be a number (optax's ValueError)."""
    warnings.warn("`optimistic_adam` is deprecated, please use `optimistic_adam_v2` instead.",
                  category=DeprecationWarning, stacklevel=2)
    if callable(learning_rate):
        raise ValueError("This version of `optimistic_adam` does not support learning rate "
                         "schedules but `optimistic_adam_v2` does.")
    _check_optional_numbers("optimistic_adam", learning_rate=learning_rate, optimism=optimism)
    if optimism is None:
        optimism = learning_rate
    return chain(scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
                               nesterov=nesterov),
                 scale_by_optimistic_gradient(alpha=learning_rate, beta=optimism),
                 scale_by_learning_rate(1.0))


__all__ += ["adadelta", "novograd", "rprop", "adan", "optimistic_gradient_descent",
            "optimistic_adam"]


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
