"""ctrainstate.optim: optax's optimizers, transforms, combinators and schedules, with
optax's names, arguments, state structures and numerics, run as fused multi-tensor
C kernels on sharded params (see the README's "Optimizers and TrainState" section).

>>> import numpy as np, ctrainstate.optim as optim
>>> tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.cosine_decay_schedule(1e-3, 100)))
>>> params = {'w': np.ones((2, 2), np.float32)}
>>> state = tx.init(params)
>>> updates, state = tx.update({'w': np.ones((2, 2), np.float32)}, state, params)
>>> new_params = optim.apply_updates(params, updates)
"""
from .base import (EmptyState, GradientTransformation, GradientTransformationExtraArgs,
                   MaskedNode, apply_updates, identity, safe_increment, with_extra_args_support)
from .transforms import *  # noqa: F401,F403
from .transforms import __all__ as _t_all
from .combine import (ApplyIfFiniteState, ConditionallyMaskState, MaskedState,
                      MultiTransformState, PartitionState, apply_if_finite, chain,
                      conditionally_mask, freeze, masked, multi_transform, partition)
from .constraining import (NonNegativeParamsState, ZeroNansState, keep_params_nonnegative,
                           zero_nans)
from .lookahead import LookaheadParams, LookaheadState, lookahead
from .schedules import *  # noqa: F401,F403
from .wrappers import (MultiSteps, MultiStepsState, skip_large_updates,
                       skip_not_finite)
from .inject import (InjectHyperparamsState, InjectStatefulHyperparamsState,
                     WrappedScheduleState, inject_hyperparams)
from .schedules import __all__ as _s_all
from .utils import (OptState, Params, ScalarOrSchedule, Schedule, Updates, global_norm,
                    incremental_update, l2_loss, periodic_update, softmax_cross_entropy,
                    softmax_cross_entropy_with_integer_labels, squared_error, stateless,
                    stateless_with_tree_map, safe_norm, safe_root_mean_squares,
                    tree_map_params)
from . import losses  # optax.losses.l2_loss, ...
from .losses import (convex_kl_divergence, cosine_distance, cosine_similarity,
                     generalized_kl_divergence, hinge_loss, huber_loss, kl_divergence,
                     kl_divergence_with_log_targets, log_cosh, multiclass_hinge_loss,
                     multiclass_perceptron_loss, ntxent, perceptron_loss,
                     poly_loss_cross_entropy, safe_softmax_cross_entropy,
                     sigmoid_binary_cross_entropy, sigmoid_focal_loss, smooth_labels,
                     triplet_margin_loss)
from .alias import (adabelief, adafactor, adagrad, adam, adamw, fromage, lamb, lars, lion,
                    noisy_sgd, radam, rmsprop, sgd, yogi, adamax, amsgrad, nadam, nadamw,
                    adamaxw, sign_sgd, signum, adadelta, novograd, rprop, adan,
                    optimistic_gradient_descent, optimistic_adam)

safe_int32_increment = safe_increment

__all__ = (["GradientTransformation", "GradientTransformationExtraArgs", "EmptyState",
            "MaskedNode", "MaskedState", "ApplyIfFiniteState", "apply_updates", "identity",
            "safe_increment", "chain", "masked", "partition", "multi_transform", "freeze",
            "PartitionState", "MultiTransformState", "apply_if_finite", "adafactor", "adagrad",
            "adam", "adamw", "lamb", "lion", "rmsprop", "sgd", "adabelief", "yogi", "radam",
            "fromage", "lars", "noisy_sgd", "adamax", "amsgrad", "inject_hyperparams", "InjectHyperparamsState",
            "InjectStatefulHyperparamsState", "WrappedScheduleState", "MultiSteps",
            "MultiStepsState", "skip_not_finite", "skip_large_updates", "safe_int32_increment",
            "l2_loss", "squared_error", "softmax_cross_entropy",
            "softmax_cross_entropy_with_integer_labels", "global_norm", "incremental_update", "periodic_update",
            "stateless", "stateless_with_tree_map", "Params", "Updates", "OptState", "Schedule",
            "ScalarOrSchedule"] + list(_t_all) + list(_s_all))
__all__ += ["sigmoid_binary_cross_entropy", "sigmoid_focal_loss", "huber_loss", "log_cosh",
            "hinge_loss", "multiclass_hinge_loss", "perceptron_loss", "multiclass_perceptron_loss",
            "kl_divergence", "kl_divergence_with_log_targets", "generalized_kl_divergence",
            "convex_kl_divergence", "cosine_similarity", "cosine_distance", "smooth_labels",
            "safe_softmax_cross_entropy", "poly_loss_cross_entropy", "triplet_margin_loss",
            "ntxent", "losses"]
__all__ += ["with_extra_args_support", "conditionally_mask", "ConditionallyMaskState",
            "NonNegativeParamsState", "ZeroNansState", "keep_params_nonnegative", "zero_nans",
            "LookaheadParams", "LookaheadState", "lookahead", "safe_norm",
            "safe_root_mean_squares", "tree_map_params", "nadam", "nadamw", "adamaxw",
            "sign_sgd", "signum", "adadelta", "novograd", "rprop", "adan",
            "optimistic_gradient_descent", "optimistic_adam"]
