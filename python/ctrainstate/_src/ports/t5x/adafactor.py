"""The implementation of :mod:`ctrainstate.t5x.adafactor` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import enum
import re
from typing import Any, Mapping, Optional

import numpy as np

from ...base import dtypes as _dtypes
from ...array.abstract import ShapeDtypeStruct, is_abstract
from ...array.array import device_put
from ...optim.base import full_like
from ...array.sharding import NamedSharding, PartitionSpec
from ...train_state.train_state import PyTreeNode
from .optimizers import OptimizerDef, OptimizerState, Optimizer, _next_step, scalar
from ...core.frozen_dict import FrozenDict, freeze
from ...serialization.state_dict import flatten_dict, unflatten_dict


def _restore(target, flat):
    """The nested dict of the '/'-keyed ``flat``, frozen when ``target`` is (as t5x's
    Adafactor keeps the kind of the params it is given)."""
    tree = unflatten_dict(flat, sep='/')
    return freeze(tree) if isinstance(target, FrozenDict) else tree

__all__ = ['Adafactor', 'FactorDim', 'HParamMap', 'HEURISTIC_RULE',
           'standard_logical_factor_rules', 'factor_name_to_factordim']


class FactorDim(enum.Enum):
    """How one dimension of a param takes part in factoring the second moment."""
    NONE = None   # not factored
    BATCH = 1     # a batch-like dim (stacked layers): never averaged over
    ROW = 2
    COLUMN = 3


class _Heuristic(enum.Enum):
    token = 1


HEURISTIC_RULE = _Heuristic.token


def standard_logical_factor_rules() -> dict:
    """t5x's default factor rules for its canonical logical axis names."""
    return {
        'vocab': FactorDim.COLUMN, 'embed': FactorDim.ROW, 'mlp': FactorDim.COLUMN,
        'heads': FactorDim.COLUMN, 'kv': FactorDim.COLUMN, 'joined_kv': FactorDim.COLUMN,
        'relpos_buckets': FactorDim.NONE, 'layers': FactorDim.BATCH, 'stack': FactorDim.BATCH,
        'q_wi_fused': FactorDim.COLUMN, 'o_wo_fused': FactorDim.COLUMN,
        'multiquery_heads': FactorDim.COLUMN, 'kv_fused': FactorDim.COLUMN,
        'layer_norm_scale': FactorDim.NONE,
    }


def factor_name_to_factordim(name):
    """``'row'``, ``'col'``/``'column'``, ``'batch'``, ``'none'``/``'unfactorized'`` -> FactorDim."""
    if not isinstance(name, str):
        return name
    table = {'row': FactorDim.ROW, 'col': FactorDim.COLUMN, 'column': FactorDim.COLUMN,
             'batch': FactorDim.BATCH, 'none': FactorDim.NONE, 'unfactorized': FactorDim.NONE}
    try:
        return table[name.lower()]
    except KeyError:
        raise ValueError(f'unknown factor name {name!r}; expected one of {sorted(table)}') from None


class HParamMap:
    """Maps '/'-joined param paths to values by the first regex that ``search``-matches."""

    def __init__(self, rules):
        self._rules = [(re.compile(r), p) for r, p in rules]

    def __getitem__(self, key: str):
        for r, p in self._rules:
            if r.search(key):
                return p
        raise KeyError(f'No factor rule found for parameter: {key}')


class _AdafactorHyperParams(PyTreeNode):
    learning_rate: Optional[float]
    factored: bool
    multiply_by_parameter_scale: Any
    beta1: Optional[float]
    decay_rate: float
    step_offset: int
    clipping_threshold: Optional[float]
    weight_decay_rate: Optional[float]
    min_dim_size_to_factor: int
    epsilon1: float
    epsilon2: float
    factor_map: Any = None
    logical_factor_rules: Any = None
    weight_decay_rate_lr_exponent: Optional[float] = None
    global_norm_clip_threshold: Optional[float] = None
    max_parameter_scale: Optional[float] = None
    skip_nan_updates: Optional[bool] = False


class _AdafactorParamState(PyTreeNode):
    v_row: Any
    v_col: Any
    v: Any
    m: Any


def _replicated_like(param):
    s = getattr(param, 'sharding', None)
    if isinstance(s, NamedSharding):
        return NamedSharding(s.mesh, PartitionSpec())
    return s


def _zeros(shape, param, like_param: bool, dtype=np.float32):
    """Zeros of ``dtype`` (float32 unless given; t5x's state dtypes do not follow the param's):
    sharded like ``param`` when ``like_param``, else replicated."""
    if like_param:
        return full_like(param, 0, dtype)
    s = _replicated_like(param)
    if is_abstract() or isinstance(param, ShapeDtypeStruct):
        return ShapeDtypeStruct(shape, np.dtype(dtype), s)
    return device_put(np.zeros(shape, dtype), s)


class Adafactor(OptimizerDef):
    """Adafactor (https://arxiv.org/abs/1804.04235) with t5x's factorisation rules."""

    def __init__(self, learning_rate: Optional[float] = None, factored: bool = True,
                 multiply_by_parameter_scale=True, beta1: Optional[float] = None,
                 decay_rate: float = 0.8, step_offset: int = 0,
                 clipping_threshold: Optional[float] = 1.0,
                 weight_decay_rate: Optional[float] = None, min_dim_size_to_factor: int = 128,
                 epsilon1: float = 1e-30, epsilon2: float = 1e-3, dtype_momentum=np.float32,
                 factor_map: Optional[HParamMap] = None,
                 logical_factor_rules: Optional[Mapping[str, FactorDim]] = None,
                 weight_decay_rate_lr_exponent: Optional[float] = None,
                 global_norm_clip_threshold: Optional[float] = None,
                 max_parameter_scale: Optional[float] = None,
                 skip_nan_updates: Optional[bool] = False):
        if not factored and factor_map is not None:
            raise ValueError('Adafactor factored is False but factorization rules have been '
                             'provided.')
        if not isinstance(multiply_by_parameter_scale, (bool, HParamMap)):
            raise TypeError('`multiply_by_parameter_scale` must be either bool or `HParamMap` '
                            f'type. Got {type(multiply_by_parameter_scale)}')
        if not isinstance(factor_map, (type(None), HParamMap)):
            raise TypeError(f'`factor_map` must be either None or `HParamMap` type. Got '
                            f'{type(factor_map)}')
        self.dtype_momentum = _dtypes.canonicalize(np.dtype(dtype_momentum))
        super().__init__(_AdafactorHyperParams(
            learning_rate, factored, multiply_by_parameter_scale, beta1, decay_rate, step_offset,
            clipping_threshold, weight_decay_rate, min_dim_size_to_factor, epsilon1, epsilon2,
            factor_map, logical_factor_rules, weight_decay_rate_lr_exponent,
            global_norm_clip_threshold, max_parameter_scale, skip_nan_updates))

    # --- factorisation ---
    @staticmethod
    def _parse_rule(rule, shape, path, fallback_to_heuristics=True):
        """(dims to average over, factored dims | HEURISTIC_RULE | None)."""
        ndim = len(shape)
        if rule is None:
            return tuple(range(ndim)), None
        if rule is HEURISTIC_RULE:
            if ndim > 2:
                raise ValueError('A parameter with rank strictly higher than 2 must have an '
                                 f'explicit factorization rule: {path}, {shape}')
            return tuple(range(ndim)), HEURISTIC_RULE
        if len(rule) != ndim:
            raise ValueError(f'Factorization rule {rule} has incorrect rank for param of rank '
                             f'{ndim}: {path}, {shape}')
        rows = tuple(i for i, d in enumerate(rule) if d == FactorDim.ROW)
        cols = tuple(i for i, d in enumerate(rule) if d == FactorDim.COLUMN)
        batch = tuple(i for i, d in enumerate(rule) if d == FactorDim.BATCH)
        averaging = tuple(i for i in range(ndim) if i not in batch)
        factored = (rows, cols) if (rows, cols) != ((), ()) else None
        if fallback_to_heuristics and ndim <= 2 and not batch:
            return tuple(range(ndim)), HEURISTIC_RULE
        return averaging, factored

    def _factored_dims(self, shape):
        if not self.hyper_params.factored or len(shape) < 2:
            return None
        order = np.argsort(shape, kind='stable')
        if shape[order[-2]] < self.hyper_params.min_dim_size_to_factor:
            return None
        return (int(order[-2]),), (int(order[-1]),)

    def _rule_for(self, path):
        if not self.hyper_params.factored:
            return None
        fm = self.hyper_params.factor_map
        return fm[path] if fm else HEURISTIC_RULE

    def init_param_state(self, param, path):
        """Zero state for one param: v_row/v_col (factored) or v, and m with momentum; unused entries ``zeros((1,))``."""
        shape = tuple(param.shape)
        _, fd = self._parse_rule(self._rule_for(path), shape, path)
        if fd is HEURISTIC_RULE:
            fd = self._factored_dims(shape)
        st = {k: _zeros((1,), param, False) for k in ('v_row', 'v_col', 'v', 'm')}
        if fd is not None:
            d1, d0 = fd
            st['v_row'] = _zeros(tuple(np.delete(shape, d0)), param, False)
            st['v_col'] = _zeros(tuple(np.delete(shape, d1)), param, False)
        else:
            st['v'] = _zeros(shape, param, True)
        if self.hyper_params.beta1 is not None:
            st['m'] = _zeros(shape, param, True, self.dtype_momentum)
        return _AdafactorParamState(**st)

    def init_state(self, params):
        """OptimizerState(step 0, per-param states in the params' structure)."""
        flat = flatten_dict(params, sep='/')
        states = {k: self.init_param_state(v, k) for k, v in flat.items()}
        return OptimizerState(scalar(0, np.int32, params), _restore(params, states))

    # --- the step ---
    def apply_param_gradient(self, step, hp, param, state, grad, path):
        """One Adafactor update of one param (host float32); returns ``(new_param, new_state)``."""
        if hp.learning_rate is None:
            raise ValueError('Adafactor: no learning rate provided (pass learning_rate= to '
                             'Adafactor or to apply_gradient)')
        f32 = np.float32
        lr = f32(hp.learning_rate)
        wd = hp.weight_decay_rate
        if hp.weight_decay_rate_lr_exponent:
            wd = (wd or 1.0) * float(lr) ** hp.weight_decay_rate_lr_exponent
        averaging, fd = self._parse_rule(self._rule_for(path), param.shape, path)
        p = np.asarray(param).astype(f32)
        g = np.asarray(grad).astype(f32)
        t = f32(int(np.asarray(step)) - hp.step_offset) + f32(1)
        decay = f32(1) - t ** f32(-hp.decay_rate)
        mixing = f32(1) - decay
        scale = lr
        mbps = hp.multiply_by_parameter_scale
        if isinstance(mbps, HParamMap):
            mbps = mbps[path]
        if mbps:
            ps = np.sqrt(np.mean(p * p, axis=averaging, keepdims=True))
            ps = np.maximum(ps, f32(hp.epsilon2))
            if hp.max_parameter_scale is not None:
                ps = np.minimum(ps, f32(hp.max_parameter_scale))
            scale = scale * ps
        g2 = g * g + f32(hp.epsilon1)
        if fd is HEURISTIC_RULE:
            fd = self._factored_dims(param.shape)
        new = {}
        if fd is not None:
            d1, d0 = fd
            v_row = decay * np.asarray(state.v_row) + mixing * np.mean(g2, axis=d0)
            v_col = decay * np.asarray(state.v_col) + mixing * np.mean(g2, axis=d1)
            new['v_row'], new['v_col'] = v_row, v_col
            red_d1 = tuple(d - len([e for e in d0 if e < d]) for d in d1)
            row_factor = (v_row / np.mean(v_row, axis=red_d1, keepdims=True)) ** f32(-0.5)
            col_factor = v_col ** f32(-0.5)
            y = g * np.expand_dims(row_factor, d0) * np.expand_dims(col_factor, d1)
        else:
            v = decay * np.asarray(state.v) + mixing * g2
            new['v'] = v
            y = g * v ** f32(-0.5)
        if hp.clipping_threshold is not None:
            y = y / np.maximum(f32(1), np.sqrt(np.mean(y * y, axis=averaging, keepdims=True))
                               / f32(hp.clipping_threshold))
        sub = scale * y
        if hp.beta1 is not None:
            m = f32(hp.beta1) * np.asarray(state.m).astype(f32) + (f32(1) - f32(hp.beta1)) * sub
            sub = m
            new['m'] = m.astype(self.dtype_momentum)
        new_p = (f32(1) - f32(wd)) * p - sub if wd is not None else p - sub
        if hp.skip_nan_updates:
            for k in list(new):
                old = np.asarray(getattr(state, k))
                new[k] = np.where(np.isnan(new[k]), old, new[k])
            new_p = np.where(np.isnan(new_p), p, new_p)
        out = {}
        for k in ('v_row', 'v_col', 'v', 'm'):
            old = getattr(state, k)
            out[k] = device_put(np.asarray(new[k]).astype(old.dtype).reshape(old.shape),
                                old.sharding) if k in new else old
        return (device_put(new_p.astype(param.dtype), param.sharding),
                _AdafactorParamState(**out))

    def apply_gradient(self, hyper_params, params, state, grads):
        """Update every param (optionally after global-norm clipping); step + 1."""
        flat_p = flatten_dict(params, sep='/')
        flat_s = flatten_dict(state.param_states, sep='/')
        flat_g = flatten_dict(grads, sep='/')
        if hyper_params.global_norm_clip_threshold:
            norm = np.sqrt(sum(float(np.sum(np.square(np.asarray(g, np.float32))))
                               for g in flat_g.values()))
            c = hyper_params.global_norm_clip_threshold
            s = np.float32(c * min(1.0 / c, 1.0 / norm))
            flat_g = {k: np.asarray(g, np.float32) * s for k, g in flat_g.items()}
        new_p, new_s = {}, {}
        for k, p in flat_p.items():
            if k not in flat_g:
                raise ValueError(f'grads have no entry for param {k}')
            new_p[k], new_s[k] = self.apply_param_gradient(state.step, hyper_params, p,
                                                           flat_s[k], flat_g[k], k)
        return (_restore(params, new_p),
                OptimizerState(_next_step(state.step), _restore(params, new_s)))

    # --- logical axes ---
    def set_param_axes(self, param_logical_axes):
        """Turn ``logical_factor_rules`` into a per-param ``factor_map`` (no-op without rules)."""
        rules = self.hyper_params.logical_factor_rules
        if rules is None:
            return
        NONE, ROW, COLUMN = FactorDim.NONE, FactorDim.ROW, FactorDim.COLUMN

        def apply_rules(path, axes):
            if axes is None:
                return None
            dims = []
            for name in axes:
                if name not in rules:
                    raise ValueError(f'Adafactor: no logical_factor_rules entry for axis '
                                     f'{name!r} of parameter {path}')
                dims.append(factor_name_to_factordim(rules[name]))
            dims = tuple(dims)
            if ROW in dims and COLUMN in dims and NONE in dims:
                raise ValueError(f'Incomplete adafactor spec {dims}!')
            if ROW not in dims or COLUMN not in dims:
                dims = tuple(NONE if x in (ROW, COLUMN) else x for x in dims)
            return dims

        flat = flatten_dict(param_logical_axes, sep='/')
        self.hyper_params = self.hyper_params.replace(
            factor_map={k: apply_rules(k, v) for k, v in flat.items()})

    def derive_logical_axes(self, optimizer, param_logical_axes):
        """Axes of the optimizer: target = param axes; v (unfactored) and m (momentum) = their
        param's axes; v_row, v_col and the step None."""
        flat_axes = flatten_dict(param_logical_axes, sep='/')
        flat_s = flatten_dict(optimizer.state.param_states, sep='/')
        out = {}
        for k, ax in flat_axes.items():
            st = flat_s[k]
            out[k] = _AdafactorParamState(
                v_row=None, v_col=None,
                v=ax if tuple(st.v.shape) != (1,) else None,
                m=ax if self.hyper_params.beta1 else None)
        return Optimizer(self, OptimizerState(None, _restore(param_logical_axes, out)),
                         param_logical_axes)


# t5x's Adafactor computes on the host (numpy, in float32, as t5x's jnp code rounds): under jit
# its update is one op node of the program, run on each call's params, state and gradients
from ...ops.node import op_node as _op_node  # noqa: E402

Adafactor.apply_gradient = _op_node("t5x.Adafactor.apply_gradient")(Adafactor.apply_gradient)

from ...base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
