"""Ops without a C plan replay as op nodes of a jitted program (ops/node.py): the eager bits,
gradients that follow each call's inputs, a clear error when a replay's output differs."""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import nn, random


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _check(fn, *calls):
    """fn jitted == fn eager on every call's arguments; traced once, replayed (no break)."""
    f = cts.jit(fn)
    for args in calls:
        for x, y in zip(cts.tree_util.tree_leaves(f(*args)), cts.tree_util.tree_leaves(fn(*args))):
            _same(x, y)
    text = f.lower(*calls[0]).as_text()
    assert "not replayable" not in text and "[op node]" in text, text
    assert f._programs.traces == 1
    return text


T = np.arange(24, dtype=np.float32).reshape(6, 4)
I1, I2 = np.array([[1, 5], [0, 0]], np.int32), np.array([[2, 3], [4, 1]], np.int32)


def test_ops_replay_as_nodes_with_the_eager_bits():
    t = cts.device_put(T)
    i1, i2 = cts.device_put(I1), cts.device_put(I2)
    x1, x2 = cts.device_put(T * 0.5), cts.device_put(T - 3.0)
    assert "take_rows[op node]" in _check(lambda t, i: cnp.take_rows(t, i) * 2.0, (t, i1), (t, i2))
    _check(lambda x, i: x[i[0]] + x[1:3, ::2].sum(), (x1, i1), (x2, i2))   # getitem
    _check(lambda x: cnp.concatenate([x, x[:2]], 0) * 2.0, (x1,), (x2,))
    _check(lambda x: cnp.split(x, 3)[1] + 1.0, (x1,), (x2,))
    _check(lambda x: cnp.cumsum(x, axis=1), (x1,), (x2,))
    _check(lambda x, i: cnp.take(x, i, axis=0), (x1, i1), (x2, i2))
    _check(lambda x, i: cnp.take_along_axis(x[:2], i, axis=1), (x1, i1), (x2, i2))
    _check(lambda i: nn.one_hot(i, 6) * 3.0, (i1,), (i2,))
    a, b = (cts.device_put(random.PRNGKey(s)) for s in (0, 1))

    def draws(k):
        k1, k2 = random.split(k)
        return (random.normal(random.fold_in(k1, 7), (3, 2)), random.bernoulli(k2, 0.3, (5,)),
                random.uniform(k2, (4,)))
    _check(draws, (a,), (b,))
    a0, a1 = random.split(random.PRNGKey(0))   # eager (numpy keys): numpy draws, the same
    _same(cts.jit(draws)(a)[1], random.bernoulli(a1, 0.3, (5,)))


def test_gradients_through_nodes_follow_each_calls_inputs():
    t = cts.device_put(T)

    def loss(w, i, x):
        e = cnp.take_rows(w, i)                     # gather: the ids are read at each replay
        s = cnp.cumsum(e * x[i[1]], axis=0)        # advanced getitem, cumsum
        return cnp.sum(cnp.square(cnp.concatenate([s, e], 0)))

    step = cts.jit(lambda w, i, x: cts.value_and_grad(loss)(w, i, x))
    grads = []
    for ids, xs in ((I1, T), (I2, T * 0.25), (I1, T)):
        i, x = cts.device_put(ids), cts.device_put(xs)
        (v, g), (ve, ge) = step(t, i, x), cts.value_and_grad(loss)(t, i, x)
        _same(v, ve)
        _same(g, ge)
        grads.append(np.asarray(g))
    assert not np.array_equal(grads[0], grads[1]) and np.array_equal(grads[0], grads[2])
    text = step.lower(t, cts.device_put(I1), cts.device_put(T)).as_text()
    assert "take_rows.vjp[op node]" in text and "cumsum.vjp[op node]" in text
    assert step._programs.traces == 1


def test_embed_under_jit_reads_its_ids_at_each_call():
    model = nn.Embed(6, 4)
    params = model.init(random.PRNGKey(0), np.zeros((2, 2), np.int32))["params"]

    def loss(p, ids):
        return cnp.sum(cnp.square(model.apply({"params": p}, ids)))
    step = cts.jit(lambda p, ids: cts.value_and_grad(loss)(p, ids))
    for ids in (I1, I2 - 4, I1):          # negative ids count from the end
        i = cts.device_put(ids)
        (v, g), (ve, ge) = step(params, i), cts.value_and_grad(loss)(params, i)
        _same(v, ve)
        _same(g["embedding"], ge["embedding"])
    assert step._programs.traces == 1
    with pytest.raises(ValueError, match="ids must be in"):
        step(params, cts.device_put(I1 + 6))


def test_a_replay_whose_node_output_differs_raises_and_memory_counts_node_outputs():
    f = cts.jit(lambda x, m: x[m] * 2.0)   # a boolean mask: the length follows the values
    x, m = cts.device_put(T[0]), np.array([True, False, True, True])
    _same(f(x, cts.device_put(m)), T[0][m] * 2.0)
    assert "getitem[op node]" in f.lower(x, cts.device_put(m)).as_text()
    with pytest.raises(RuntimeError, match=r"getitem.*another type, shape, dtype or sharding"):
        f(x, cts.device_put(~m))
    t, i = cts.device_put(T), cts.device_put(I1)
    g = cts.jit(lambda t, i: cnp.take_rows(t, i) * 2.0)
    ma = g.lower(t, i).compile().memory_analysis()
    # the gathered rows (a node's output, 2*2*4 floats) and the product (the output) are new
    assert ma.temp_size_in_bytes == 64 and ma.output_size_in_bytes == 64
    assert ma.peak_size_in_bytes == T.nbytes + I1.nbytes + 128
