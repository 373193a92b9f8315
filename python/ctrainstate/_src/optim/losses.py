"""The implementation of :mod:`ctrainstate.optim.losses` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import warnings

import numpy as np

from ..ops import ops as _ops
from .utils import (l2_loss, softmax_cross_entropy, softmax_cross_entropy_with_integer_labels,
                    squared_error)
from ..base import dtypes as _dtypes
from ..numpy_lax import numpy as cnp
from ...nn.activation import log_sigmoid, log_softmax, softmax

__all__ = ["l2_loss", "squared_error", "softmax_cross_entropy",
           "softmax_cross_entropy_with_integer_labels", "sigmoid_binary_cross_entropy",
           "sigmoid_focal_loss", "huber_loss", "log_cosh", "hinge_loss", "multiclass_hinge_loss",
           "perceptron_loss", "multiclass_perceptron_loss", "kl_divergence",
           "kl_divergence_with_log_targets", "generalized_kl_divergence", "convex_kl_divergence",
           "cosine_similarity", "cosine_distance", "smooth_labels", "safe_softmax_cross_entropy",
           "poly_loss_cross_entropy", "triplet_margin_loss", "ntxent"]


# --- helpers ------------------------------------------------------------------------------------


def _dtype(x):
    return _dtypes.canonicalize(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)


def _shape(x):
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def _check_float(x, who, what):
    """optax's ``check_subdtype(x, jnp.floating)``: a TypeError for int / bool inputs."""
    dt = _dtype(x)
    if dt not in (_dtypes.float32, _dtypes.bfloat16, _dtypes.float16):
        raise TypeError(f"{who}: {what} must be a floating-point array, got dtype {dt}")


def _check_same_shape(a, b, who):
    if _shape(a) != _shape(b):
        raise ValueError(f"{who}: Shape mismatch: got {_shape(a)} and {_shape(b)} (the "
                         f"targets must have the predictions' shape)")


def _no_where(who, where):
    if where is not None:
        raise NotImplementedError(f"{who}: where= is not supported; weight the per-example "
                                  f"losses instead")


def _cast_like(labels, logits):
    """optax's ``jnp.astype(labels, logits.dtype)``."""
    dt = _dtype(logits)
    if _dtype(labels) == dt:
        return labels
    if hasattr(labels, "_blocks"):
        return _ops.astype(labels, dt)
    return np.asarray(labels).astype(dt)


def _errors(predictions, targets, who):
    _check_float(predictions, who, "predictions")
    if targets is None:
        return predictions
    _check_same_shape(predictions, targets, who)
    return _ops.subtract(predictions, targets)


def _int_labels(labels, scores, who):
    """Integer class labels of ``scores.shape[:-1]`` in ``[0, classes)``, as a host array
    (optax one-hots them; a label of another shape would broadcast, one outside the range
    would give a zero one-hot row: both a meaningless loss)."""
    lab = np.asarray(labels)
    if not np.issubdtype(lab.dtype, np.integer):
        raise TypeError(f"{who}: labels must be integers, got {lab.dtype}")
    shape = _shape(scores)
    if len(shape) == 0:
        raise ValueError(f"{who}: scores need a class axis (the last)")
    if lab.shape != shape[:-1]:
        raise ValueError(f"{who}: labels of shape {lab.shape} for scores of shape {shape}; "
                         f"expected {shape[:-1]}")
    n = shape[-1]
    if lab.size and (lab.min() < 0 or lab.max() >= n):
        raise ValueError(f"{who}: labels must be in [0, {n}); got values in "
                         f"[{lab.min()}, {lab.max()}]")
    return lab


def _one_hot(lab, n, like):
    """The host one-hot of ``lab``, placed where ``like`` lives."""
    oh = (lab[..., None] == np.arange(n)).astype(np.float32)
    return _ops._lift(oh, _ops._place_of(like))


# --- classification -----------------------------------------------------------------------------


def _sigmoid_bce(logits, labels):
    log_p = log_sigmoid(logits)
    log_not_p = log_sigmoid(_ops.negative(logits))
    return _ops.subtract(_ops.multiply(_ops.negative(labels), log_p),
                         _ops.multiply(_ops.subtract(1.0, labels), log_not_p))


_sigmoid_bce_p = _ops._with_dtype_policy(_sigmoid_bce, (0, 1))


def sigmoid_binary_cross_entropy(logits, labels):
    """Elementwise sigmoid cross entropy (optax's): ``-labels * log_sigmoid(logits) -
    (1 - labels) * log_sigmoid(-logits)``. ``labels`` (0/1 or probabilities) are cast to the
    logits' dtype and broadcast against them, as in optax.

    >>> import numpy as np, ctrainstate.optim as optim
    >>> round(float(optim.sigmoid_binary_cross_entropy(np.float32(0.0), np.float32(1.0))), 6)
    0.693147
    """
    _check_float(logits, "sigmoid_binary_cross_entropy", "logits")
    return _sigmoid_bce_p(logits, _cast_like(labels, logits))


def _focal(logits, labels, alpha, gamma):
    ce = _sigmoid_bce(logits, labels)
    log_p = log_sigmoid(logits)
    log_q = log_sigmoid(_ops.negative(logits))
    # jax.scipy.special.logsumexp([log_p, log_q], b=[1 - labels, labels]) along a new axis:
    # the terms of zero weight are -inf, the maximum (finite, else 0) a constant
    b1 = _ops.subtract(1.0, labels)
    b2 = labels
    a1 = _ops.where(_ops._lift(b1) != 0, log_p, -np.inf)
    a2 = _ops.where(_ops._lift(b2) != 0, log_q, -np.inf)
    amax = _ops.maximum(a1, a2)
    amax = _ops.stop_gradient(_ops.where(_isfinite(amax), amax, 0.0))
    sumexp = _ops.add(_ops.multiply(_ops.exp(_ops.subtract(a1, amax)), b1),
                      _ops.multiply(_ops.exp(_ops.subtract(a2, amax)), b2))
    log_1m_pt = _ops.add(_ops.log(_ops.abs(sumexp)), amax)
    log_1m_pt = _ops.where(_ops.sign(sumexp) < 0, np.nan, log_1m_pt)
    loss = _ops.multiply(ce, _ops.exp(_ops.multiply(gamma, log_1m_pt)))
    if alpha is None:
        return loss
    w = _ops.add(_ops.multiply(alpha, labels),
                 _ops.multiply(1.0 - alpha, _ops.subtract(1.0, labels)))
    return _ops.multiply(w, loss)


def _isfinite(x):
    return cnp.isfinite(x)


_focal_p = _ops._with_dtype_policy(_focal, (0, 1))


def sigmoid_focal_loss(logits, labels, *, alpha=None, gamma=2.0):
    """Sigmoid focal loss (optax's, Lin et al. 2017): ``sigmoid_binary_cross_entropy *
    (1 - p_t) ** gamma``, with ``log(1 - p_t)`` computed as optax does (a weighted
    ``logsumexp`` of ``log_sigmoid(logits)`` and ``log_sigmoid(-logits)``), and the
    ``alpha * labels + (1 - alpha) * (1 - labels)`` weighting when ``alpha`` is given."""
    _check_float(logits, "sigmoid_focal_loss", "logits")
    return _focal_p(logits, _cast_like(labels, logits), alpha, gamma)


def hinge_loss(predictor_outputs, targets):
    """Binary hinge loss (optax's): ``maximum(0, 1 - predictor_outputs * targets)``, targets in
    {-1, 1}. The targets must have the outputs' shape (optax broadcasts silently)."""
    _check_same_shape(predictor_outputs, targets, "hinge_loss")
    return _ops.maximum(0.0, _ops.subtract(1.0, _ops.multiply(predictor_outputs, targets)))


def perceptron_loss(predictor_outputs, targets):
    """Binary perceptron loss (optax's): ``maximum(0, -predictor_outputs * targets)``, targets
    in {-1, 1} of the outputs' shape (a ValueError otherwise, as optax)."""
    if _shape(predictor_outputs) != _shape(targets):
        raise ValueError(f"Shape mismatch: got {_shape(predictor_outputs)} and "
                         f"{_shape(targets)}.")
    return _ops.maximum(0.0, _ops.multiply(_ops.negative(predictor_outputs), targets))


def _mc_hinge(scores, lab):
    scores = _ops._lift(scores)
    oh = _one_hot(lab, scores.shape[-1], scores)
    return _ops.subtract(_ops.max(_ops.subtract(_ops.add(scores, 1.0), oh), axis=-1),
                         _ops.sum(_ops.multiply(scores, oh), axis=-1))


def _mc_perceptron(scores, lab):
    scores = _ops._lift(scores)
    oh = _one_hot(lab, scores.shape[-1], scores)
    return _ops.subtract(_ops.max(scores, axis=-1), _ops.sum(_ops.multiply(scores, oh), axis=-1))


_mc_hinge_p = _ops._with_dtype_policy(_mc_hinge, (0,))
_mc_perceptron_p = _ops._with_dtype_policy(_mc_perceptron, (0,))


def multiclass_hinge_loss(scores, labels):
    """Multiclass hinge loss (optax's): ``max(scores + 1 - one_hot(labels), -1) -
    scores[label]``. ``labels``: integers of ``scores.shape[:-1]`` in ``[0, classes)``."""
    return _mc_hinge_p(scores, _int_labels(labels, scores, "multiclass_hinge_loss"))


def multiclass_perceptron_loss(scores, labels):
    """Multiclass perceptron loss (optax's): ``max(scores, -1) - scores[label]``; labels as
    :func:`multiclass_hinge_loss`'s."""
    return _mc_perceptron_p(scores, _int_labels(labels, scores, "multiclass_perceptron_loss"))


def _kl(log_predictions, targets, axis):
    t = _ops._lift(targets)
    safe_log = _ops.where(t == 0, 0.0, _ops.log(t))
    return _ops.sum(_ops.multiply(t, _ops.subtract(safe_log, log_predictions)), axis=axis)


_kl_p = _ops._with_dtype_policy(_kl, (0, 1))


def kl_divergence(log_predictions, targets, axis=-1, where=None):
    """Kullback-Leibler divergence (optax's): ``sum(targets * (where(targets == 0, 0,
    log(targets)) - log_predictions), axis)``; ``log_predictions`` are log-probabilities."""
    _check_float(log_predictions, "kl_divergence", "log_predictions")
    _check_float(targets, "kl_divergence", "targets")
    _no_where("kl_divergence", where)
    return _kl_p(log_predictions, targets, axis)


def _kl_log(log_predictions, log_targets, axis):
    return _ops.sum(_ops.multiply(_ops.exp(log_targets),
                                  _ops.subtract(log_targets, log_predictions)), axis=axis)


_kl_log_p = _ops._with_dtype_policy(_kl_log, (0, 1))


def kl_divergence_with_log_targets(log_predictions, log_targets, axis=-1, where=None):
    """KL divergence with log-probability targets (optax's): ``sum(exp(log_targets) *
    (log_targets - log_predictions), axis)``."""
    _check_float(log_predictions, "kl_divergence_with_log_targets", "log_predictions")
    _check_float(log_targets, "kl_divergence_with_log_targets", "log_targets")
    _no_where("kl_divergence_with_log_targets", where)
    return _kl_log_p(log_predictions, log_targets, axis)


def _gkl(log_predictions, targets, axis):
    return _ops.add(_kl(log_predictions, targets, axis),
                    _ops.sum(_ops.subtract(_ops.exp(log_predictions), targets), axis=axis))


_gkl_p = _ops._with_dtype_policy(_gkl, (0, 1))


def generalized_kl_divergence(log_predictions, targets, axis=-1, where=None):
    """Generalized KL divergence (optax's): ``kl_divergence + sum(exp(log_predictions) -
    targets, axis)``; for unnormalized distributions."""
    _check_float(log_predictions, "generalized_kl_divergence", "log_predictions")
    _check_float(targets, "generalized_kl_divergence", "targets")
    _no_where("generalized_kl_divergence", where)
    return _gkl_p(log_predictions, targets, axis)


def convex_kl_divergence(log_predictions, targets, axis=-1, where=None):
    """Deprecated in optax for :func:`generalized_kl_divergence` (same value); warns with
    optax's DeprecationWarning."""
    warnings.warn("The function convex_kl_divergence is deprecated. Please use "
                  "generalized_kl_divergence instead.", category=DeprecationWarning, stacklevel=2)
    return generalized_kl_divergence(log_predictions, targets, axis=axis, where=where)


def _safe_ce(logits, labels):
    x = _ops._lift(logits)
    w = _ops._lift(labels, _ops._place_of(x))
    ls = log_softmax(x, axis=-1)
    # optax's weighted_logsoftmax: where(w != 0, w * log_softmax(x), 0), with its custom JVP
    # (x: w * g - w * sum(g * softmax); w: g * log_softmax(x), unmasked), whose transpose is
    # recorded here as the vjp
    raw = _ops.stop_gradient
    nz = raw(w) != 0
    val = _ops.where(nz, _ops.multiply(raw(w), raw(ls)), 0.0)

    def vjp(g):
        sm = softmax(raw(x), axis=-1)
        wg = _ops.multiply(raw(w), g)
        gx = _ops.subtract(wg, _ops.multiply(sm, _ops.sum(wg, axis=-1, keepdims=True)))
        return gx, _ops.multiply(g, raw(ls))
    val = _ops._record(val, (x, w), vjp)
    return _ops.negative(_ops.sum(val, axis=-1))


_safe_ce_p = _ops._with_dtype_policy(_safe_ce, (0, 1))


def safe_softmax_cross_entropy(logits, labels):
    """Softmax cross entropy (last axis) that stays finite where a logit is ``-inf`` and its
    label 0 (optax's: ``0 * log 0 = 0`` by a custom JVP, reproduced here as the gradient)."""
    _check_float(logits, "safe_softmax_cross_entropy", "logits")
    return _safe_ce_p(logits, labels)


def _poly(logits, labels, epsilon, axis):
    p = softmax(logits, axis=axis)
    one_minus_pt = _ops.sum(_ops.multiply(labels, _ops.subtract(1.0, p)), axis=axis)
    ce = softmax_cross_entropy(logits, labels, axis=axis)
    return _ops.add(ce, _ops.multiply(epsilon, one_minus_pt))


_poly_p = _ops._with_dtype_policy(_poly, (0, 1))


def poly_loss_cross_entropy(logits, labels, *, epsilon=2.0, axis=-1, where=None):
    """PolyLoss (optax's, Leng et al. 2022): ``softmax_cross_entropy + epsilon * sum(labels
    * (1 - softmax(logits)), axis)``."""
    _check_float(logits, "poly_loss_cross_entropy", "logits")
    _check_float(labels, "poly_loss_cross_entropy", "labels")
    _no_where("poly_loss_cross_entropy", where)
    return _poly_p(logits, labels, epsilon, axis)


# --- regression -----------------------------------------------------------------------------


def _huber(errors, delta):
    abs_errors = _ops.abs(errors)
    quadratic = _ops.minimum(abs_errors, delta)
    linear = _ops.subtract(abs_errors, quadratic)   # optax: avoids doubling the gradient
    return _ops.add(_ops.multiply(0.5, _ops.square(quadratic)), _ops.multiply(delta, linear))


_huber_p = _ops._with_dtype_policy(_huber, (0,))


def huber_loss(predictions, targets=None, *, delta=1.0):
    """Huber loss (optax's): ``0.5 * min(|e|, delta)**2 + delta * (|e| - min(|e|, delta))``
    with ``e = predictions - targets`` (``targets=None``: zeros); targets of another shape
    raise ValueError (optax broadcasts)."""
    return _huber_p(_errors(predictions, targets, "huber_loss"), delta)


def _log_cosh(errors):
    # logaddexp(e, -e) - log(2) = |e| + log1p(exp(-2|e|)) - log(2); gradient tanh(e)
    ae = _ops.abs(errors)
    return _ops.subtract(_ops.add(ae, _ops.log1p(_ops.exp(_ops.multiply(-2.0, ae)))),
                         float(np.log(np.float32(2.0))))


_log_cosh_p = _ops._with_dtype_policy(_log_cosh, (0,))


def log_cosh(predictions, targets=None):
    """``log(cosh(predictions - targets))`` (optax's, computed as ``logaddexp(e, -e) -
    log 2``: stable for large errors); targets of another shape raise ValueError."""
    return _log_cosh_p(_errors(predictions, targets, "log_cosh"))


def _cos(predictions, targets, epsilon, axis):
    a = _ops._lift(predictions)
    b = _ops._lift(targets, _ops._place_of(a))
    a_norm = _ops.sqrt(_ops.maximum(epsilon, _ops.sum(_ops.square(a), axis=axis, keepdims=True)))
    b_norm = _ops.sqrt(_ops.maximum(epsilon, _ops.sum(_ops.square(b), axis=axis, keepdims=True)))
    return _ops.sum(_ops.multiply(_ops.divide(a, a_norm), _ops.divide(b, b_norm)), axis=axis)


_cos_p = _ops._with_dtype_policy(_cos, (0, 1))


def cosine_similarity(predictions, targets, *, epsilon=0.0, axis=-1, where=None):
    """Cosine similarity along ``axis`` (optax's): the sum of the products of the two unit
    vectors, each norm clipped below at ``sqrt(epsilon)``."""
    _check_float(predictions, "cosine_similarity", "predictions")
    _check_float(targets, "cosine_similarity", "targets")
    _no_where("cosine_similarity", where)
    return _cos_p(predictions, targets, epsilon, axis)


def cosine_distance(predictions, targets, *, epsilon=0.0, axis=-1, where=None):
    """``1 - cosine_similarity`` (optax's)."""
    _check_float(predictions, "cosine_distance", "predictions")
    _check_float(targets, "cosine_distance", "targets")
    _no_where("cosine_distance", where)
    return _ops.subtract(1.0, cosine_similarity(predictions, targets, epsilon=epsilon,
                                                axis=axis))


def smooth_labels(labels, alpha, *, axis=-1, where=None):
    """Label smoothing (optax's): ``(1 - alpha) * labels + alpha / num_categories``, the
    number of categories the size of ``axis`` (an int or a tuple: the product)."""
    _check_float(labels, "smooth_labels", "labels")
    _no_where("smooth_labels", where)
    shape = _shape(labels)
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    n = 1
    for a in axes:
        if not -len(shape) <= a < len(shape):
            raise ValueError(f"smooth_labels: axis {a} is out of bounds for labels of shape "
                             f"{shape}")
        n *= shape[a]
    return _ops.add(_ops.multiply(1.0 - alpha, labels), alpha / n)


# --- self-supervised ----------------------------------------------------------------------------


def _triplet(anchors, positives, negatives, axis, norm_degree, margin, eps):
    def dist(other):
        s = _ops.sum(_ops.power(_ops.subtract(anchors, other), norm_degree), axis=axis)
        return _ops.power(_ops.add(s, eps), 1 / norm_degree)
    return _ops.maximum(_ops.add(_ops.subtract(dist(positives), dist(negatives)), margin), 0.0)


_triplet_p = _ops._with_dtype_policy(_triplet, (0, 1, 2))


def triplet_margin_loss(anchors, positives, negatives, axis=-1, norm_degree=2, margin=1.0,
                        eps=1e-6):
    """Triplet margin loss (optax's): ``maximum(d(a, p) - d(a, n) + margin, 0)`` with
    ``d(x, y) = (sum((x - y) ** norm_degree, axis) + eps) ** (1 / norm_degree)``."""
    for x, what in ((anchors, "anchors"), (positives, "positives"), (negatives, "negatives")):
        _check_float(x, "triplet_margin_loss", what)
    return _triplet_p(anchors, positives, negatives, axis, norm_degree, margin, eps)


def _ntxent(embeddings, labels, temperature):
    e = _ops._lift(embeddings)
    n = e.shape[0]
    eps = float(np.finfo(np.float32).eps)
    xcs = _ops.divide(_cos(_ops.expand_dims(e, 0), _ops.expand_dims(e, 1), eps, -1),
                      temperature)
    lab = np.asarray(labels)
    same = lab[:, None] == lab[None, :]
    diffs = ~same
    matches = same & ~np.eye(n, dtype=bool)              # no self similarity
    place = _ops._place_of(xcs)
    diffs_a = _ops._lift(diffs, place)
    matches_a = _ops._lift(matches, place)
    xd = _ops.where(diffs_a, xcs, -np.inf)
    xm = _ops.where(matches_a, xcs, -np.inf)
    comb = cnp.concatenate((xd, xm), axis=-1)
    xmax = _ops.stop_gradient(_ops.max(comb, axis=1, keepdims=True))
    sd = _ops.subtract(xd, xmax)
    sm = _ops.subtract(xm, xmax)
    denom = _ops.add(_ops.sum(_ops.exp(sd), axis=1, keepdims=True), _ops.exp(sm))
    log_softm = _ops.subtract(sm, _ops.log(denom))
    total = _ops.sum(_ops.where(matches_a, log_softm, 0.0))
    return _ops.divide(_ops.negative(total), float(matches.sum()))


_ntxent_p = _ops._with_dtype_policy(_ntxent, (0,))


def ntxent(embeddings, labels, temperature=0.07):
    """Normalized temperature-scaled cross entropy (optax's, SimCLR): over the cosine
    similarities of ``embeddings`` (``[batch, dim]``) scaled by ``1 / temperature``, the mean
    over positive pairs (same label, not the same row) of ``-log softmax`` against the
    negatives. ``labels``: a host array of ``batch`` labels."""
    _check_float(embeddings, "ntxent", "embeddings")
    lab = np.asarray(labels)
    if lab.ndim != 1 or lab.shape[0] != _shape(embeddings)[0]:
        raise ValueError(
            f"Labels and embeddings must have the same leading dimension, found "
            f"{lab.shape[0] if lab.ndim else lab.shape} for labels and "
            f"{_shape(embeddings)[0] if _shape(embeddings) else ()} for embeddings.")
    if len(_shape(embeddings)) != 2:
        raise ValueError(f"ntxent: embeddings must be [batch, dim], got shape "
                         f"{_shape(embeddings)}")
    return _ntxent_p(embeddings, lab, temperature)


from ..base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
