"""Ops without a C plan replay as op nodes of a jitted program (ops/node.py): the eager bits,
gradients that follow each call's inputs, a clear error when a replay's output differs."""
import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import nn, random
from memory_checks import measured_vs_predicted


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _check(fn, *calls, node=True):
    """fn jitted == fn eager on every call's arguments; traced once, replayed (no break);
    with an op node among its steps (``node``), else C steps only."""
    f = cts.jit(fn)
    for args in calls:
        for x, y in zip(cts.tree_util.tree_leaves(f(*args)), cts.tree_util.tree_leaves(fn(*args))):
            _same(x, y)
    text = f.lower(*calls[0]).as_text()
    assert "not replayable" not in text and ("[op node]" in text) == node, text
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
    # (one_hot: the labels compared with an iota constant, C steps only)
    assert "equal[ewise]" in _check(lambda i: nn.one_hot(i, 6) * 3.0, (i1,), (i2,), node=False)
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
    g(t, i)
    ma = g.lower(t, i).compile().memory_analysis()
    # the gathered rows (a node's output, 2*2*4 floats) and the product (the output) are new;
    # the gather's own temporaries, measured at the trace, come on top of its output
    assert ma.temp_size_in_bytes >= 64 and ma.output_size_in_bytes == 64
    assert ma.argument_size_in_bytes == T.nbytes + I1.nbytes
    ((measured, predicted),) = measured_vs_predicted(g, t, i)[0].values()
    assert measured == predicted >= 128


@pytest.mark.parametrize("dtype", [np.float32, cnp.bfloat16])
def test_memory_analysis_counts_op_nodes_temporaries_and_residuals(dtype):
    """An op node's own temporaries (a bfloat16 product computed in float32) and, under
    value_and_grad, the residuals its tape keeps until its backward node, measured at the
    trace: the predicted peak is the measured one."""
    x = cts.device_put(np.linspace(-1, 1, 64 * 64, dtype=np.float32).reshape(4, 16, 64)).astype(dtype)

    def step(w):
        return cts.value_and_grad(lambda v: cnp.sum((v @ v.transpose(0, 2, 1) * v[:, :, :16])
                                                    .astype(np.float32)))(w)
    j = cts.jit(step)
    j(x)
    got, (loss, g) = measured_vs_predicted(j, x)
    assert "[op node]" in j.lower(x).as_text()
    # (within a few bytes: what a node allocates at the trace differs by one 4-byte scalar
    # with the state earlier tests leave behind, seen in this bfloat16 case)
    for dev, (measured, predicted) in got.items():
        assert abs(measured - predicted) <= 8, (dev, measured, predicted)
    el, eg = step(x)
    _same(loss, el)
    _same(g, eg)


def _hf_example(argv, measure=True):
    """examples/hf_model_parallel.py's main, with its jitted train step measured at the third
    call (``measure``): [(measured, predicted) per device], and the printed lines."""
    import contextlib
    import io
    import os
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "examples"))
    try:
        import hf_model_parallel as hf_ex
    finally:
        sys.path.pop(0)
    seen = []
    real = cts.pjit

    def spy(f, *a, **k):
        j = real(f, *a, **k)
        if f.__name__ != "train_step" or not measure:
            return j
        calls = []

        def step(state, batch):
            calls.append(1)
            if len(calls) != 3:
                return j(state, batch)
            assert "[op node]" in j.lower(state, batch).as_text()
            got, out = measured_vs_predicted(j, state, batch)
            seen.append(got)
            return out
        return step
    buf = io.StringIO()
    hf_ex.cts.pjit = spy
    try:
        with contextlib.redirect_stdout(buf):
            hf_ex.main(argv)
    finally:
        hf_ex.cts.pjit = real
    return seen, buf.getvalue()


def test_hf_example_step_replays_with_the_eager_losses_and_its_memory_known():
    """The HF example's pjit'd train step (embedding gather, dropout, batched attention
    products, AdamW) replays — the eager run's losses bit for bit — and memory_analysis
    predicts each device's peak within 5%."""
    seen, out = _hf_example(["--steps", "4", "--layers", "1", "--print-losses"])
    _, eager = _hf_example(["--steps", "4", "--layers", "1", "--print-losses", "--eager"],
                           measure=False)
    losses = [ln for ln in out.splitlines() if ln.startswith("loss ")]
    assert len(losses) == 4 and losses == [ln for ln in eager.splitlines() if ln.startswith("loss ")]
    (got,) = seen
    assert len(got) == len(cts.devices())
    for dev, (measured, predicted) in got.items():
        assert abs(measured - predicted) <= 0.05 * predicted, (dev, measured, predicted)


def test_device_put_inside_jit_reshards_at_each_call():
    """cts.device_put(x, other_sharding) in a jitted function (jax allows it) is an op node:
    each call's values are resharded (not a constant of the program)."""
    mesh = cts.Mesh(np.array(cts.devices()[:4], dtype=object).reshape(2, 2), ("x", "y"))
    row = cts.NamedSharding(mesh, cts.P("x", None))
    col = cts.NamedSharding(mesh, cts.P(None, "y"))
    f = cts.jit(lambda a: cts.device_put(a * 2.0, col) + 1.0)
    for v in (T, T * 3.0):
        a = cts.device_put(v, row)
        out = f(a)
        assert out.sharding == col and np.asarray(out).tolist() == (v * 2.0 + 1.0).tolist()
    assert "device_put[op node]" in f.lower(cts.device_put(T, row)).as_text()
    assert f._programs.traces == 1
