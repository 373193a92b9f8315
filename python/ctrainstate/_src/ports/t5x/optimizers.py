"""The implementation of :mod:`ctrainstate.t5x.optimizers` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from .... import optim
from ...array.abstract import ShapeDtypeStruct
from ...array.array import Array, device_put
from ...core.frozen_dict import FrozenDict, freeze
from .... import _C
from ...optim.base import EmptyState, MaskedNode, apply_updates, run_fused, scalar, traced_step
from ...array.sharding import PartitionSpec
from ...train_state.train_state import PyTreeNode, field
from ...base.traverse_util import ModelParamTraversal
from ...base.tree_util import tree_flatten, tree_leaves, tree_structure, tree_unflatten
from ...serialization.state_dict import (flatten_dict, from_state_dict, to_state_dict,
                                        unflatten_dict)
from ...base.tree_util import _flatten_up_to as f

__all__ = [
    'OptimizerState', 'OptimizerDef', 'Optimizer', 'OptaxWrapper', 'OptaxStatePartitionRules',
    'derive_optax_logical_axes', 'wrap_optax_optimizer', 'MultiOptimizer',
    'ModelParamTraversal', 'chain', 'adam', 'adamw', 'sgd', 'lion', 'rmsprop', 'adagrad',
    'lamb', 'adafactor', 'adabelief', 'yogi', 'radam', 'fromage', 'lars', 'noisy_sgd', 'adamax', 'amsgrad', 'multi_transform',
]


class OptimizerState(PyTreeNode):
    """``(step, param_states)`` (flax.optim.OptimizerState)."""
    step: Any
    param_states: Any


class OptimizerDef:
    """Base class of an optimizer definition: hyper-parameters plus the pure functions
    ``init_state(params)`` and ``apply_gradient(hyper_params, params, state, grads)``."""

    def __init__(self, hyper_params):
        self.hyper_params = hyper_params

    def apply_param_gradient(self, step, hyper_params, param, state, grad):
        """Update one param: ``(new_param, new_param_state)`` (per-param optimizers)."""
        raise NotImplementedError()

    def init_param_state(self, param):
        """The state of one param (per-param optimizers)."""
        raise NotImplementedError()

    def apply_gradient(self, hyper_params, params, state, grads):
        """Per-leaf ``apply_param_gradient`` over the tree; returns ``(new_params, new_state)``."""
        p_leaves, td = tree_flatten(params)
        s_leaves = _flatten_up_to(td, state.param_states)
        g_leaves = tree_leaves(grads)
        out = [self.apply_param_gradient(state.step, hyper_params, p, s, g)
               for p, s, g in zip(p_leaves, s_leaves, g_leaves)]
        new_params = tree_unflatten(td, [o[0] for o in out])
        new_states = tree_unflatten(td, [o[1] for o in out])
        return new_params, OptimizerState(_next_step(state.step), new_states)

    def init_state(self, params):
        """OptimizerState(step 0, one state per param leaf)."""
        leaves, td = tree_flatten(params)
        return OptimizerState(scalar(0, np.int32, params),
                              tree_unflatten(td, [self.init_param_state(p) for p in leaves]))

    def update_hyper_params(self, **hyper_param_overrides):
        """The hyper-parameters with overrides (``hyper_params=`` replaces them all)."""
        hp = hyper_param_overrides.pop('hyper_params', self.hyper_params)
        if hyper_param_overrides:
            hp = hp.replace(**hyper_param_overrides)
        return hp

    def create(self, target) -> 'Optimizer':
        """An :class:`Optimizer` for ``target`` (numpy leaves are placed on devices)."""
        target = _place(target)
        return Optimizer(self, self.init_state(target), target)

    def state_dict(self, target, state) -> dict:
        """``{'target': ..., 'state': {'step', 'param_states'}}`` as nested dicts."""
        return to_state_dict({'target': to_state_dict(target), 'state': to_state_dict(state)})

    def restore_state(self, opt_target, opt_state, state_dict):
        """``(target, state)`` rebuilt from ``state_dict`` in the structure of the given ones."""
        opt_target = from_state_dict(opt_target, state_dict['target'], 'target')
        opt_state = from_state_dict(opt_state, state_dict['state'], 'state')
        return opt_target, opt_state


def _flatten_up_to(td, tree):
    return f(td, tree)


def _next_step(step):
    if isinstance(step, (Array, ShapeDtypeStruct)):
        if isinstance(step, ShapeDtypeStruct):
            return step
        return scalar(int(np.asarray(step)) + 1, np.int32, sharding=step.sharding)
    return np.int32(int(step) + 1)


def _place(tree):
    leaves = tree_leaves(tree)
    if all(isinstance(x, (Array, ShapeDtypeStruct)) for x in leaves):
        return tree
    return device_put(tree)


def _check_grads_like(params, grads) -> None:
    """Grads (a dict tree like the params) have the same param paths and shapes."""
    if not (isinstance(params, dict) and isinstance(grads, dict)):
        return
    pl, pdef = tree_flatten(params)
    gl, gdef = tree_flatten(grads)
    if pdef == gdef and all(
            (g.shape if hasattr(g, 'shape') else np.shape(g)) ==
            (p.shape if hasattr(p, 'shape') else np.shape(p)) for p, g in zip(pl, gl)):
        return   # the common case, per step: no dict flattening
    fp, fg = flatten_dict(params, sep='/'), flatten_dict(grads, sep='/')
    missing = [k for k in fp if k not in fg]
    if missing:
        raise ValueError(f"apply_gradient: grads have no entry for param {missing[0]!r} "
                         f"({len(missing)} missing)")
    extra = [k for k in fg if k not in fp]
    if extra:
        raise ValueError(f"apply_gradient: grads have an entry {extra[0]!r} that is not a param")
    for k, p in fp.items():
        ps, gs = tuple(np.shape(p)), tuple(np.shape(fg[k]))
        if ps != gs:
            raise ValueError(f"apply_gradient: grads[{k!r}] has shape {gs}, the param {ps}")


class Optimizer(PyTreeNode):
    """An optimizer definition (static) with its state and target (flax.optim.Optimizer)."""
    optimizer_def: Any = field(pytree_node=False)
    state: Any = None
    target: Any = None

    def apply_gradient(self, grads, **hyper_param_overrides) -> 'Optimizer':
        """One step; hyper-parameter overrides (e.g. ``learning_rate=``) apply to this step.
        Grads must have the target's params, with their shapes (else a ValueError names the
        first param that differs)."""
        if not getattr(self.optimizer_def, '_validates_grads', False):
            _check_grads_like(self.target, grads)
        hp = self.optimizer_def.update_hyper_params(**hyper_param_overrides)
        new_target, new_state = self.optimizer_def.apply_gradient(hp, self.target, self.state,
                                                                  grads)
        return self.replace(state=new_state, target=new_target)

    def state_dict(self) -> dict:
        """The state dict of ``target`` and ``state``."""
        return self.optimizer_def.state_dict(self.target, self.state)

    def restore_state(self, state) -> 'Optimizer':
        """Restore target and state from ``state``."""
        target, st = self.optimizer_def.restore_state(self.target, self.state, state)
        return self.replace(target=target, state=st)


# --- optax state axes ------------------------------------------------------------------------------

def _spec_leaf(x):
    return x is None or isinstance(x, PartitionSpec)


def _masked_leaf(x):
    return isinstance(x, MaskedNode)


def derive_optax_logical_axes(opt_state, params, params_axes, *, empty_as_none: bool = False):
    """The axes tree of an optax-structured optimizer state.

    Every subtree with the structure of ``params`` (mu, nu, trace, ema, accumulators,
    possibly with ``MaskedNode`` holes) gets the params' axes leaf by leaf — ``None`` for a
    leaf whose shape differs from its param's (factored moments); every other leaf
    (counters, rng keys, hyper-parameters) gets ``None``. Containers keep their types, so
    the result can serve as a pjit spec tree. ``empty_as_none`` turns ``EmptyState()`` into
    ``None`` (HuggingFace's run_clm_mp convention).

    >>> import numpy as np, ctrainstate.optim as optim
    >>> from ctrainstate import P
    >>> params = {'w': np.zeros((4, 2), np.float32)}
    >>> tx = optim.adamw(1e-3)
    >>> derive_optax_logical_axes(tx.init(params), params, {'w': P('embed', 'mlp')})
    (ScaleByAdamState(count=None, mu={'w': PartitionSpec('embed', 'mlp')}, nu={'w': PartitionSpec('embed', 'mlp')}), EmptyState(), EmptyState())
    """
    if params is None:  # t5x's two-argument form: the structure comes from the axes alone
        a_leaves, p_def = tree_flatten(params_axes, is_leaf=_spec_leaf)
        params, p_leaves, p_shapes = params_axes, a_leaves, None
    else:
        p_leaves, p_def = tree_flatten(params)
        a_leaves = _flatten_up_to(p_def, params_axes) if params_axes is not None else \
            [None] * len(p_leaves)
        p_shapes = [tuple(np.shape(p)) for p in p_leaves]

    def rec(s):
        if isinstance(s, MaskedNode):
            return s
        if isinstance(s, EmptyState) and empty_as_none:
            return None
        if s is None:
            return None
        leaves, sdef = tree_flatten(s, is_leaf=_masked_leaf)
        if leaves and len(leaves) == len(p_leaves) and _same_structure(
                sdef, p_def, s, params, from_axes=p_shapes is None):
            out = []
            for leaf, shape, ax in zip(leaves, p_shapes or [None] * len(leaves), a_leaves):
                if isinstance(leaf, MaskedNode):
                    out.append(leaf)
                else:
                    out.append(ax if p_shapes is None or tuple(np.shape(leaf)) == shape
                               else None)
            return tree_unflatten(sdef, out)
        if isinstance(s, tuple) and hasattr(type(s), '_fields'):
            return type(s)(*[rec(v) for v in s])
        if isinstance(s, (tuple, list)):
            return type(s)(rec(v) for v in s)
        if isinstance(s, dict):
            return type(s)((k, rec(v)) for k, v in s.items())
        return None
    return rec(opt_state)


def _same_structure(sdef, pdef, s, params, from_axes=False) -> bool:
    if sdef == pdef:
        return True
    # a subtree whose masked leaves are MaskedNode: compare with MaskedNode as leaves
    p_leaf = (lambda x: _masked_leaf(x) or _spec_leaf(x)) if from_axes else _masked_leaf
    try:
        return tree_structure(s, is_leaf=_masked_leaf) == tree_structure(
            params, is_leaf=p_leaf)
    except Exception:
        return False


class OptaxStatePartitionRules:
    """t5x's name for the derivation (``derive_optax_logical_axes``).

    ``derive_optax_logical_axes(optax_state, params_axes)`` is t5x's call: without
    ``params`` the subtrees shaped like the params are found from the structure of
    ``params_axes`` alone (pass ``params=`` to also give factored moments None).
    """

    @classmethod
    def derive_optax_logical_axes(cls, optax_state, params_axes, params=None):
        """The axes tree of ``optax_state`` (see :func:`derive_optax_logical_axes`)."""
        return derive_optax_logical_axes(optax_state, params, params_axes)

    @classmethod
    def derive_params_axes(cls, optax_params, params_axes):
        """``params_axes`` with the ``MaskedNode`` holes of ``optax_params`` kept."""
        a_leaves, a_def = tree_flatten(params_axes, is_leaf=_spec_leaf)
        o_leaves = _flatten_up_to(a_def, optax_params)
        return tree_unflatten(a_def, [o if isinstance(o, MaskedNode) else a
                                      for a, o in zip(a_leaves, o_leaves)])


class _OptaxHyperParams(PyTreeNode):
    learning_rate: Any = None


class OptaxWrapper(OptimizerDef):
    """A ctrainstate.optim (optax) transformation as a t5x ``OptimizerDef``.

    ``param_states`` is the transformation's own state (optax structure).
    """

    def __init__(self, optax_optimizer):
        self.optax_optimizer = optax_optimizer
        super().__init__(_OptaxHyperParams())

    def init_state(self, params):
        """OptimizerState(step 0, the transformation's ``init(params)``)."""
        return OptimizerState(scalar(0, np.int32, params), self.optax_optimizer.init(params))

    @property
    def _validates_grads(self) -> bool:
        """A fused step checks the grads itself (path, shape and dtype errors, before any
        update), so Optimizer.apply_gradient skips its own check on this hot path."""
        return bool(getattr(self.optax_optimizer, 'fusable', False))

    def apply_gradient(self, hyper_params, params, state, grads):
        """One optax step; ``hyper_params`` (and so ``learning_rate``) are ignored."""
        del hyper_params
        tx = self.optax_optimizer
        if _C.trace_active() and getattr(tx, 'fusable', False):   # inside a jit trace
            r = _traced_apply(tx, params, state, grads)
            if r is not None:
                return r
        plan = None
        d = getattr(state, '__dict__', {})
        last = d.get('_ct_plan')
        if last is not None and last.fast is not None and '_ct_cur' in d:
            # the persistent plan of the last step (optim.base.FastPlan): one C call
            r = last.fast.step(d['_ct_cur'], grads, params)
            if r is not None:
                new_state = OptimizerState(_next_step(state.step), r[2])
                new_state.__dict__['_ct_plan'], new_state.__dict__['_ct_cur'] = last, r[0]
                return r[1], new_state
        if getattr(tx, 'fusable', False) and not _abstract_tree(params):
            # the kernel's block list of the last step, reused while the buffers are the same
            # (see ctrainstate.optim.base.Plan); it lives on the state this step returns
            new_params, new_ps, plan = run_fused(
                tx, grads, state.param_states, params, inplace=True, want_plan=True,
                plan=getattr(state, '__dict__', {}).get('_ct_plan'))
        else:
            updates, new_ps = tx.update(grads, state.param_states, params)
            new_params = apply_updates(params, updates)
        new_state = OptimizerState(_next_step(state.step), new_ps)
        if plan is not None and hasattr(new_state, '__dict__'):
            object.__setattr__(new_state, '_ct_plan', plan)
            if plan.fast is not None:
                object.__setattr__(new_state, '_ct_cur', plan.fast.cplan.arrays)
        return new_params, new_state

    def derive_logical_axes(self, optimizer, param_logical_axes):
        """An :class:`Optimizer` whose target is ``param_logical_axes`` and whose state holds
        the derived axes (step and counters None)."""
        ps = derive_optax_logical_axes(optimizer.state.param_states, optimizer.target,
                                       param_logical_axes)
        return Optimizer(self, OptimizerState(None, ps), param_logical_axes)

    def state_dict(self, target, state):
        """The state dict without the empty dicts of stateless transforms (in ``'state'``
        only: the target keeps its structure, as in t5x)."""
        sd = super().state_dict(target, state)
        sd['state'] = _drop_empty(sd['state'])
        return sd

    def restore_state(self, opt_target, opt_state, state_dict):
        """Restore from a state dict (empty states come back from the target structure)."""
        return super().restore_state(opt_target, opt_state, state_dict)


def _traced_apply(tx, params, state, grads):
    """The step as one node of the program a jit trace records (``optim.base.traced_step``:
    the params' and optimizer state's Arrays stepped in place, the step advanced by
    :func:`_next_step`), or None where it cannot be one: the eager step then runs."""
    d = getattr(state, '__dict__', {})
    r = traced_step(tx, params, state.param_states, grads, state.step, d.get('_ct_plan'),
                    _next_step)
    if r is None:
        return None
    new_params, new_ps, new_step = r
    return new_params, OptimizerState(new_step, new_ps)


def _abstract_tree(t) -> bool:
    return any(isinstance(x, ShapeDtypeStruct) for x in tree_leaves(t))


def _drop_empty(d):
    if isinstance(d, dict) and not isinstance(d, PartitionSpec):
        out = {}
        for k, v in d.items():
            v = _drop_empty(v)
            if isinstance(v, dict) and not v:
                continue
            out[k] = v
        return out
    return d


def wrap_optax_optimizer(optax_optimizer: Callable) -> Callable:
    """``ctor`` -> a function with the same arguments returning ``OptaxWrapper(ctor(...))``."""
    def wrapped(*args, **kwargs):
        return OptaxWrapper(optax_optimizer(*args, **kwargs))
    wrapped.__name__ = getattr(optax_optimizer, '__name__', 'optimizer')
    wrapped.__doc__ = f'OptaxWrapper over ctrainstate.optim.{wrapped.__name__}.'
    return wrapped


def _chain(*transformations):
    """t5x's ``chain(transformations)`` takes one sequence of transformations; optax's
    varargs form ``chain(t1, t2)`` is accepted too."""
    if len(transformations) == 1 and not hasattr(transformations[0], 'init'):
        transformations = tuple(transformations[0])
    return optim.chain(*transformations)


_chain.__name__ = 'chain'
chain = wrap_optax_optimizer(_chain)
adam = wrap_optax_optimizer(optim.adam)
adamw = wrap_optax_optimizer(optim.adamw)
sgd = wrap_optax_optimizer(optim.sgd)
lion = wrap_optax_optimizer(optim.lion)
rmsprop = wrap_optax_optimizer(optim.rmsprop)
adagrad = wrap_optax_optimizer(optim.adagrad)
lamb = wrap_optax_optimizer(optim.lamb)
adafactor = wrap_optax_optimizer(optim.adafactor)
adabelief = wrap_optax_optimizer(optim.adabelief)
yogi = wrap_optax_optimizer(optim.yogi)
radam = wrap_optax_optimizer(optim.radam)
fromage = wrap_optax_optimizer(optim.fromage)
lars = wrap_optax_optimizer(optim.lars)
noisy_sgd = wrap_optax_optimizer(optim.noisy_sgd)
adamax = wrap_optax_optimizer(optim.adamax)
amsgrad = wrap_optax_optimizer(optim.amsgrad)
multi_transform = wrap_optax_optimizer(optim.multi_transform)


# --- MultiOptimizer ----------------------------------------------------------------------------------

class MultiOptimizer(OptimizerDef):
    """Different optimizer definitions for different parts of the params.

    ``traversals_and_optimizers``: pairs ``(ModelParamTraversal, OptimizerDef)``. Each
    sub-optimizer must keep one state per param (like :class:`~ctrainstate.t5x.adafactor.Adafactor`).
    Params no traversal selects are not updated and get param state ``None``; a param
    selected twice raises ``ValueError``.
    """

    def __init__(self, traversals_and_optimizers: Sequence):
        traversals, optimizers = zip(*traversals_and_optimizers)
        self.traversals = list(traversals)
        self.sub_optimizers = list(optimizers)
        super().__init__([o.hyper_params for o in self.sub_optimizers])

    def _assign(self, params) -> dict:
        owner: dict = {}
        overlap = False
        for i, tr in enumerate(self.traversals):
            for p in tr.paths(params):
                overlap |= p in owner
                owner.setdefault(p, []).append(i)
        if overlap:
            raise ValueError('Multiple optimizers match the same leaves : ' + str(
                {p: (ix if len(ix) > 1 else ix[0]) for p, ix in owner.items()}))
        return {p: ix[0] for p, ix in owner.items()}

    def _subtree(self, params, owner, i):
        flat = flatten_dict(params, sep='/')
        return unflatten_dict({k: v for k, v in flat.items() if owner.get(k) == i}, sep='/')

    def init_state(self, params):
        """Sub-optimizer states for the params each selects; None elsewhere."""
        owner = self._assign(params)
        flat = {k: None for k in flatten_dict(params, sep='/')}
        for i, opt in enumerate(self.sub_optimizers):
            sub = self._subtree(params, owner, i)
            if not sub:
                continue
            st = opt.init_state(sub)
            flat.update(_per_param(st.param_states, sub, opt))
        return OptimizerState(scalar(0, np.int32, params), unflatten_dict(flat, sep='/'))

    def apply_gradient(self, hyper_params, params, state, grads):
        """Each sub-optimizer updates its params; step + 1."""
        owner = self._assign(params)
        fp, fs, fg = (flatten_dict(t, sep='/') for t in (params, state.param_states, grads))
        new_p, new_s = dict(fp), dict(fs)
        for i, (opt, hp) in enumerate(zip(self.sub_optimizers, hyper_params)):
            keys = [k for k in fp if owner.get(k) == i]
            if not keys:
                continue
            sp = unflatten_dict({k: fp[k] for k in keys}, sep='/')
            sg = unflatten_dict({k: fg[k] for k in keys}, sep='/')
            ss = unflatten_dict({k: fs[k] for k in keys}, sep='/')
            p2, s2 = opt.apply_gradient(hp, sp, OptimizerState(state.step, ss), sg)
            new_p.update(flatten_dict(p2, sep='/'))
            new_s.update(_per_param(s2.param_states, sp, opt))
        return (unflatten_dict(new_p, sep='/'),
                OptimizerState(_next_step(state.step), unflatten_dict(new_s, sep='/')))

    def update_hyper_params(self, **overrides):
        """Overrides applied to every sub-optimizer's hyper-params (``hyper_params=[...]``
        replaces them; other overrides then apply to the given ones, as in t5x)."""
        hps = overrides.pop('hyper_params', None)
        hps = list(hps) if hps is not None else [o.hyper_params for o in self.sub_optimizers]
        return [hp.replace(**overrides) for hp in hps] if overrides else hps

    def set_param_axes(self, param_logical_axes):
        """Pass each sub-optimizer that takes them the logical axes of the params its
        traversal selects (as t5x does: the others' axis names need no factor rule)."""
        flat = flatten_dict(param_logical_axes, sep='/')
        saved = [getattr(opt, 'hyper_params', None) for opt in self.sub_optimizers]
        try:
            for tr, opt in zip(self.traversals, self.sub_optimizers):
                if hasattr(opt, 'set_param_axes'):
                    opt.set_param_axes(unflatten_dict(
                        {k: flat[k] for k in tr.paths(param_logical_axes)}, sep='/'))
        except Exception:   # no sub-optimizer keeps the axes of a call that failed
            for opt, hp in zip(self.sub_optimizers, saved):
                if hp is not None:
                    opt.hyper_params = hp
            raise

    def derive_logical_axes(self, optimizer, param_logical_axes):
        """Axes of every sub-optimizer's state; None for params no traversal selects and for
        those of a sub-optimizer without ``derive_logical_axes`` (as in t5x)."""
        owner = self._assign(optimizer.target)
        flat_axes = flatten_dict(param_logical_axes, sep='/')
        flat = {k: None for k in flatten_dict(optimizer.target, sep='/')}
        fs = flatten_dict(optimizer.state.param_states, sep='/')
        for i, opt in enumerate(self.sub_optimizers):
            keys = [k for k in flat if owner.get(k) == i]
            if not keys or not hasattr(opt, 'derive_logical_axes'):  # t5x: axes None there
                continue
            sub_t = unflatten_dict({k: flatten_dict(optimizer.target, sep='/')[k] for k in keys},
                                   sep='/')
            sub_s = unflatten_dict({k: fs[k] for k in keys}, sep='/')
            sub_a = unflatten_dict({k: flat_axes[k] for k in keys}, sep='/')
            sub_opt = Optimizer(opt, OptimizerState(optimizer.state.step, sub_s), sub_t)
            d = opt.derive_logical_axes(sub_opt, sub_a)
            flat.update(_per_param(d.state.param_states, sub_t, opt))
        states = unflatten_dict(flat, sep='/')
        if isinstance(param_logical_axes, FrozenDict):   # the kind of the params, as in t5x
            states = freeze(states)
        return Optimizer(self, OptimizerState(None, states), param_logical_axes)


def _per_param(param_states, sub_params, opt) -> dict:
    """Flatten per-param states to the params' '/' paths (each state stays whole)."""
    out = {}
    for path in flatten_dict(sub_params, sep='/'):
        node = param_states
        try:
            for k in path.split('/'):
                node = node[k]
        except (KeyError, TypeError):
            raise TypeError(f'MultiOptimizer needs sub-optimizers with one state per param; '
                            f'{type(opt).__name__} has none at {path}') from None
        out[path] = node
    return out


from ...base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
