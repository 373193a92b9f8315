"""The static memory plan of a replay (csrc/python/py_dispatch.c, plan_memory): values that only
plain steps and fused chains make and read live in one arena per device, allocated once a run,
at offsets shared by values whose lifetimes do not overlap.

The checks derive each value's lifetime on their own, from ``memory_plan()``'s steps (which
step makes a value, which read it) and the fused chains, and compare it with the layout
(``arena_layout()``): two values live at the same time never share bytes. Then a run's peak
is the plan's, and the results are the eager ones bit for bit.
"""
import collections
import threading

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from memory_checks import measured_vs_predicted

rng = np.random.default_rng(7)


def _mesh():
    return cts.Mesh(np.array(cts.devices()[:8]).reshape(2, 4), ("x", "y"))


def _program(j, *args):
    return j.lower(*args).compile()._prog


def lifetimes(prog, fused=True):
    """{value: (first step, last step)} of the arena values, from memory_plan() and chains: a
    value is live from the step that makes it (a chain's first) to the end of the step that
    reads it last (a read inside a fused chain lasts to the chain's end)."""
    values, steps, outs, _ = prog.memory_plan()
    group = list(range(len(steps)))   # step -> the last step of its chain (itself if none)
    for first, n in prog.chains if fused else ():
        for q in range(first, first + n):
            group[q] = first + n - 1
    made, read = {}, {}
    for k, (ins, outs_k, *_) in enumerate(steps):
        for o in outs_k:
            made[o] = k
        for i in ins:
            read[i] = max(read.get(i, -1), group[k])
    return {v: (made[v], read[v]) for v, (kind, _, _) in enumerate(values) if kind == "arena"}


def check_layout(prog, fused=True):
    """Every arena value laid out, on its own devices, within its arena, apart from the values
    live at the same time; returns the layout's bytes per device."""
    life = lifetimes(prog, fused)
    layout = prog.arena_layout()
    arenas = dict(prog.memory_plan()[3][2])
    assert {v for v, *_ in layout} == set(life)
    per_dev = collections.defaultdict(list)
    for v, dev, off, nbytes, first, last in layout:
        assert (first, last) == life[v], (v, (first, last), life[v])
        assert off % 64 == 0 and 0 <= off and off + nbytes <= arenas[dev]
        per_dev[dev].append((v, off, nbytes))
    for dev, blocks in per_dev.items():
        for i, (u, ou, nu) in enumerate(blocks):
            for v, ov, nv in blocks[:i]:
                (fu, lu), (fv, lv) = life[u], life[v]
                if fu <= lv and fv <= lu:   # live at the same time: apart in memory
                    assert ou + nu <= ov or ov + nv <= ou, (dev, u, v)
    return arenas


def test_values_of_one_size_reuse_the_arena_by_lifetime():
    """Eight products, each read only by the next: two are live at once, so the arena holds
    two (16 KiB each), not eight; the run allocates exactly what the plan says."""
    n = 64
    x = cts.device_put(rng.standard_normal((n, n)).astype(np.float32))
    w = cts.device_put((rng.standard_normal((n, n)) / 8).astype(np.float32))

    def f(x, w):
        h = x
        for _ in range(8):
            h = cnp.matmul(h, w)
        return cnp.sum(h)
    j = cts.jit(f)
    eager = f(x, w)
    j(x, w)
    prog = _program(j, x, w)
    arenas = check_layout(prog)
    assert arenas == {cts.devices()[0].id: 2 * n * n * 4}
    assert (f"# static memory plan: 8 values in one arena per device (at most {2 * n * n * 4} "
            f"bytes)") in prog.as_text()
    assert len(lifetimes(prog)) == 8   # (the last product too: the sum reads it)
    assert j.lower(x, w).compile().memory_analysis().temp_size_in_bytes == 2 * n * n * 4
    got, out = measured_vs_predicted(j, x, w)
    ((measured, predicted),) = got.values()
    assert measured == predicted == 2 * n * n * 4 + 4   # the arena, then the sum's output
    assert np.asarray(out).tobytes() == np.asarray(eager).tobytes()


def test_sizes_are_placed_largest_first_around_each_other():
    """A (16 KiB) is read by B (4 KiB) only; C (20 KiB) is made from B. In order of steps a
    first-fit heap would put C past A's freed 16 KiB (40 KiB); placed by size, C and A share
    the start and B sits after C: 24 KiB, the most ever live at once (B and C)."""
    x = cts.device_put(rng.standard_normal((64, 64)).astype(np.float32))
    w1 = cts.device_put(rng.standard_normal((64, 64)).astype(np.float32))
    w2 = cts.device_put(rng.standard_normal((64, 16)).astype(np.float32))
    w3 = cts.device_put(rng.standard_normal((16, 80)).astype(np.float32))

    def f(x, w1, w2, w3):
        a = x @ w1
        b = a @ w2
        c = b @ w3
        return cnp.sum(c)
    j = cts.jit(f)
    eager = f(x, w1, w2, w3)
    j(x, w1, w2, w3)
    prog = _program(j, x, w1, w2, w3)
    assert check_layout(prog) == {cts.devices()[0].id: (64 * 16 + 64 * 80) * 4}
    got, out = measured_vs_predicted(j, x, w1, w2, w3)
    ((measured, predicted),) = got.values()
    assert measured == predicted
    assert np.asarray(out).tobytes() == np.asarray(eager).tobytes()


@pytest.mark.parametrize("fuse", [True, False])
def test_layout_of_a_training_step_with_chains_on_a_mesh(fuse):
    """A value_and_grad + optimizer step on the 2x4 mesh, with fused chains (their inner
    results never exist; a read inside a chain lasts to its end) and without: the layout
    keeps live values apart, the run's peak is the predicted one, the results are the eager
    ones bit for bit."""
    from ctrainstate import optim
    from ctrainstate.train_state import TrainState
    mesh = _mesh()
    put = lambda a, *spec: cts.device_put(a, cts.NamedSharding(mesh, cts.P(*spec)))
    init = {"w0": (rng.standard_normal((2, 32)).astype(np.float32), (None, "y")),
            "b0": (np.zeros(32, np.float32), ("y",)),
            "w1": ((rng.standard_normal((32, 32)) / 4).astype(np.float32), ("y", None)),
            "w2": ((rng.standard_normal((32, 3)) / 4).astype(np.float32), (None, None))}
    # (two copies: the jitted step updates its state's buffers in place)
    params = lambda: {k: put(a.copy(), *spec) for k, (a, spec) in init.items()}
    x = put(rng.standard_normal((64, 2)).astype(np.float32), "x")
    t = put(rng.standard_normal((64, 3)).astype(np.float32), "x")

    def step(state, x, t):
        def loss_fn(p):
            h = cnp.sin(30.0 * (x @ p["w0"] + p["b0"]))
            h = cnp.tanh(h @ p["w1"]) * 0.5 + h
            return cnp.mean(cnp.square(h @ p["w2"] - t))
        loss, g = cts.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=g), loss
    with mesh:
        s_eager = TrainState.create(apply_fn=None, params=params(), tx=optim.adam(1e-2))
        s_jit = TrainState.create(apply_fn=None, params=params(), tx=optim.adam(1e-2))
        j = cts.jit(step)
        s_jit, _ = j(s_jit, x, t)
        prog = _program(j, s_jit, x, t)
        prog.set_fusion(fuse)
        assert bool(prog.chains) and len(lifetimes(prog, fuse)) > 10
        check_layout(prog, fuse)
        got, (s_jit, loss) = measured_vs_predicted(j, s_jit, x, t)
        for measured, predicted in got.values():
            assert measured == predicted
        for _ in range(2):
            s_eager, l_eager = step(s_eager, x, t)
        assert np.asarray(loss).tobytes() == np.asarray(l_eager).tobytes()
        for a, b in zip(cts.tree_util.tree_leaves(s_jit.params), cts.tree_util.tree_leaves(s_eager.params)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_a_value_an_op_node_reads_or_the_caller_gets_is_an_array_of_its_own():
    """Values read by an op node (Python code at each replay) and outputs are never in the
    arena: the node gets Arrays, the caller keeps results that later calls do not overwrite."""
    x = cts.device_put(rng.standard_normal((16, 8)).astype(np.float32))
    idx = cts.device_put(np.array([3, 0, 15, 7], np.int32))

    def f(x, idx):
        h = cnp.matmul(x, cnp.transpose(x))   # read by the node
        rows = cnp.take(h, idx, axis=0)          # an op node
        g = cnp.sum(h, axis=1)                   # an output
        return rows * 2.0, g
    j = cts.jit(f)
    j(x, idx)
    prog = _program(j, x, idx)
    values, steps, outs, _ = prog.memory_plan()
    node_ins = {i for ins, _, node, scratch, _ in steps if scratch is not None or node for i in ins}
    arena = {v for v, (kind, _, _) in enumerate(values) if kind == "arena"}
    assert not (arena & node_ins) and not (arena & set(outs))
    first = j(x, idx)
    keep = [np.asarray(a).copy() for a in first]
    x2 = cts.device_put(rng.standard_normal((16, 8)).astype(np.float32))
    second = j(x2, idx)
    for a, k in zip(first, keep):
        assert np.asarray(a).tobytes() == k.tobytes()   # untouched by the second call
    for a, e in zip(second, f(x2, idx)):
        assert np.asarray(a).tobytes() == np.asarray(e).tobytes()


def test_runs_on_several_threads_at_once_give_the_eager_bits():
    """A run holds the arenas; a run on another thread meanwhile (the kernels of large steps
    release the GIL) allocates its values one by one instead: every result is right."""
    n = 256
    w = cts.device_put((rng.standard_normal((n, n)) / 16).astype(np.float32))

    def f(x, w):
        h = cnp.matmul(x, w)
        h = cnp.matmul(cnp.sin(h), w)
        return cnp.sum(cnp.matmul(h, w), axis=0)
    j = cts.jit(f)
    xs = [cts.device_put(rng.standard_normal((n, n)).astype(np.float32)) for _ in range(4)]
    want = [np.asarray(f(x, w)).tobytes() for x in xs]
    j(xs[0], w)
    errors = []

    def work(t):
        try:
            for _ in range(15):
                got = np.asarray(j(xs[t], w)).tobytes()
                if got != want[t]:
                    errors.append(t)
        except Exception as e:   # noqa: BLE001 (reported below)
            errors.append(repr(e))
    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert j._programs.traces == 1


def test_an_op_node_returning_an_inputs_buffers_adds_no_memory():
    """On a (1, 1) mesh an add of a float32 and an int32 Array (the Python op: a promotion) is
    an op node, and its vjp passes the float32 operand's cotangent through: the gradient is
    the cotangent's buffer. The plan records that (the output over its input), so the
    predicted peak is the measured one."""
    mesh = cts.Mesh(np.array(cts.devices()[:1]).reshape(1, 1), ("x", "y"))
    put = lambda a, *spec: cts.device_put(a, cts.NamedSharding(mesh, cts.P(*spec)))
    a = put(rng.standard_normal((64, 32)).astype(np.float32), None, "y")
    b = put(rng.integers(-3, 4, (64, 32)).astype(np.int32))

    def f(a, b):
        return cts.value_and_grad(lambda a: cnp.sum(cnp.sin(a + b) * 2.0))(a)
    j = cts.jit(f)
    j(a, b)
    prog = _program(j, a, b)
    values, steps, outs, _ = prog.memory_plan()
    aliased = [(k, pairs) for k, (*_, pairs) in enumerate(steps) if pairs]
    assert len(aliased) == 1 and "add.vjp[op node]" in prog.as_text()
    ((o, i),) = aliased[0][1]
    assert o == outs[1] and i in steps[aliased[0][0]][0]   # the gradient, over the cotangent
    got, (v, g) = measured_vs_predicted(j, a, b)
    ((measured, predicted),) = got.values()
    assert measured == predicted
    ve, ge = f(a, b)
    assert np.asarray(v).tobytes() == np.asarray(ve).tobytes()
    assert np.asarray(g).tobytes() == np.asarray(ge).tobytes()
