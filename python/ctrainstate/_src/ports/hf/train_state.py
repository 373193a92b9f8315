"""The implementation of :mod:`ctrainstate.hf.train_state` (which re-exports its API; the module
docstring is there)."""
from __future__ import annotations

import collections
import functools
import itertools
from typing import Any

import numpy as np

from .... import random
from ...base.devices import local_device_count, local_devices
from ...array.array import Array, device_put
from ...train_state.train_state import TrainState as _FlaxTrainState
from ...base.tree_util import tree_map
from ...numpy_lax import numpy as jnp
from ...numpy_lax.pmap import device_put_replicated, device_put_sharded
from ...array.array import device_get
from ...base.tree_util import keystr, tree_leaves, tree_map_with_path

__all__ = ['TrainState', 'replicate', 'unreplicate', 'shard', 'shard_prng_key', 'onehot',
           'get_metrics', 'stack_forest', 'prefetch_to_device', 'pad_shard_unpad']


def _host(x):
    if isinstance(x, Array):
        return np.asarray(x)
    return np.asarray(x)


def replicate(tree, devices=None):
    """One copy of each leaf per device, stacked on a new leading axis (flax.jax_utils):
    :func:`ctrainstate.device_put_replicated` over ``devices`` (default: the local ones)."""
    return device_put_replicated(tree, list(devices) if devices is not None else local_devices())


def unreplicate(tree):
    """Copy 0 of each replicated leaf: ``x[0]`` (flax.jax_utils.unreplicate). A shard that
    holds all of row 0 is read alone (copy 0 on its device); otherwise the row is gathered
    from the shards that hold it."""
    def first(x):
        if isinstance(x, Array):
            for s in x.addressable_shards:
                idx = s.index
                whole = all(sl.start in (0, None) and sl.stop in (None, n)
                            for sl, n in zip(idx[1:], x.shape[1:]))
                if idx and idx[0].start in (0, None) and whole and s.data is not None:
                    return device_put(np.asarray(s.data)[0], s.device)
            return x[0]
        return np.asarray(x)[0]
    return tree_map(first, tree)


def shard(xs):
    """Reshape every leaf to ``(local_device_count, -1, *rest)`` (flax.training.common_utils)."""
    n = local_device_count()

    def split(path, x):
        x = np.asarray(x)
        if x.ndim == 0 or x.shape[0] % n:
            raise ValueError(f"shard: {keystr(path) or 'the batch'} has shape {x.shape}; its "
                             f"leading dimension must divide by the {n} local devices")
        return x.reshape((n, -1) + x.shape[1:])
    return tree_map_with_path(split, xs)


def shard_prng_key(prng_key):
    """``random.split(key, local_device_count)``: one dropout key per device."""
    return random.split(prng_key, local_device_count())


def prefetch_to_device(iterator, size: int, devices=None):
    """flax.jax_utils.prefetch_to_device: the elements of ``iterator`` (pytrees whose leaves
    have a leading dimension of ``len(devices)``, e.g. :func:`shard`'s output) placed ahead of
    use, ``size`` at a time, each leaf with :func:`ctrainstate.device_put_sharded` (slice
    ``i`` on ``devices[i]``, the layout :func:`ctrainstate.pmap` takes without a gather).
    ``devices`` defaults to the local devices. Placement is synchronous here, so the lookahead
    bounds memory (``size`` placed batches) rather than hiding transfer time."""

    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 0:
        raise ValueError(f"prefetch_to_device: size must be a non-negative int, got {size!r}")
    devs = list(devices) if devices is not None else local_devices()
    iterator = iter(iterator)
    queue: collections.deque = collections.deque()

    def put(xs):
        n = np.shape(xs)[0] if np.ndim(xs) else None
        if n != len(devs):
            raise ValueError(f"prefetch_to_device: a leaf of shape {np.shape(xs)} must have a "
                             f"leading dimension of {len(devs)} (one slice per device); "
                             f"shard(batch) makes it so")
        return device_put_sharded(list(xs), devs)

    def enqueue(k):
        for data in itertools.islice(iterator, k):
            queue.append(tree_map(put, data))

    enqueue(max(size, 1))
    while queue:
        yield queue.popleft()
        enqueue(1)


def pad_shard_unpad(wrapped, static_argnums=(0,), static_argnames=(), static_return=False):
    """flax.jax_utils.pad_shard_unpad: ``wrapped`` (typically a pmapped eval step whose
    first argument is the replicated params) called on batches of any size. The leaves of
    the other arguments (one batch size ``b`` for all) are zero-padded on the host to a
    multiple of the local device count ``d`` and reshaped to ``(d, b_d, ...)`` (at least
    ``min_device_batch`` per device when that keyword is given); the outputs are brought to
    the host, reshaped back to ``(d * b_d, ...)`` and cut to ``b`` (``static_return=True``:
    returned as they are, e.g. pmean'd metrics).

    >>> import numpy as np, ctrainstate as cts
    >>> from ctrainstate.hf import pad_shard_unpad, replicate
    >>> f = pad_shard_unpad(cts.pmap(lambda w, x: x * w))
    >>> f(replicate(np.float32(2.0)), np.arange(3, dtype=np.float32)).tolist()
    [0.0, 2.0, 4.0]
    """

    static_argnums = tuple(static_argnums) if not isinstance(static_argnums, int) else (
        static_argnums,)
    static_argnames = ((static_argnames,) if isinstance(static_argnames, str)
                       else tuple(static_argnames))

    @functools.wraps(wrapped)
    def wrapper(*args, min_device_batch=None, **kw):
        d = local_device_count()
        sizes = {}
        for i, a in enumerate(args):
            if i not in static_argnums:
                for t in tree_leaves(a):
                    sizes.setdefault(np.shape(t)[0] if np.ndim(t) else None, f"argument {i}")
        for k, v in kw.items():
            if k not in static_argnames:
                for t in tree_leaves(v):
                    sizes.setdefault(np.shape(t)[0] if np.ndim(t) else None, f"keyword {k!r}")
        if None in sizes:
            raise ValueError(f"pad_shard_unpad: {sizes[None]} has a 0-d leaf; the padded "
                             f"arguments need a batch dimension (mark it static otherwise)")
        if len(sizes) != 1:
            raise ValueError(f"pad_shard_unpad: inconsistent batch sizes {sorted(sizes)} "
                             f"(first seen in {', '.join(sizes[s] for s in sorted(sizes))}); "
                             "every padded leaf needs the same leading dimension")
        b = next(iter(sizes))

        def pad(x):
            x = np.asarray(x)
            shape = x.shape[1:]
            db, rest = divmod(b, d)
            if rest:
                x = np.concatenate([x, np.zeros((d - rest,) + shape, x.dtype)], axis=0)
                db += 1
            if min_device_batch and db < min_device_batch:
                x = np.concatenate([x, np.zeros((d * (min_device_batch - db),) + shape,
                                                x.dtype)])
                db = min_device_batch
            return x.reshape((d, db) + shape)

        args = [a if i in static_argnums else tree_map(pad, a) for i, a in enumerate(args)]
        kw = {k: v if k in static_argnames else tree_map(pad, v) for k, v in kw.items()}
        out = wrapped(*args, **kw)
        if static_return:
            return out

        def unpad(x):
            h = np.asarray(device_get(x))
            return h.reshape((h.shape[0] * h.shape[1],) + h.shape[2:])[:b]
        return tree_map(unpad, out)
    return wrapper


def stack_forest(forest):
    """One tree whose leaves stack the matching leaves of the trees in ``forest`` (host
    arrays; flax.training.common_utils.stack_forest)."""
    return tree_map(lambda *xs: np.stack([_host(x) for x in xs]), *forest)


def get_metrics(device_metrics):
    """A list of replicated metric trees -> one host tree of copy 0 of each leaf, stacked
    over the list (flax.training.common_utils.get_metrics)."""
    return stack_forest([tree_map(lambda x: _host(unreplicate(x)), m) for m in device_metrics])


def onehot(labels, num_classes, on_value=1.0, off_value=0.0):
    """float32 one-hot vectors of length ``num_classes`` on a new last axis, ``on_value``
    where ``labels`` holds the index (flax.training.common_utils.onehot)."""
    labels = jnp.asarray(labels)
    x = labels[..., None] == jnp.arange(num_classes).reshape((1,) * labels.ndim + (-1,))
    return jnp.where(x, jnp.full(x.shape, on_value), jnp.full(x.shape, off_value)).astype(
        jnp.float32)


class TrainState(_FlaxTrainState):
    """run_clm_flax.py's ``TrainState``: flax's, plus ``dropout_rng`` and ``replicate()``.

    ``apply_gradients(grads=g, dropout_rng=new_rng)`` replaces the rng with the step.
    """

    dropout_rng: Any = None

    def replicate(self):
        """The state on every local device, with a different dropout key per device."""
        return replicate(self).replace(dropout_rng=shard_prng_key(self.dropout_rng))


from ...base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
