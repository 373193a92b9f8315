"""nn.scan / nn.vmap (flax.linen.scan / vmap) and partitioning.scan_with_axes / vmap_with_axes /
remat: Flax's variable layout, names and metadata (reference table rows P9, P11, M5, M9), the
same parameter values as flax.linen for the same key (split RNG streams included), the same
outputs and gradients (flax's values through conftest's jax_ref: recorded in
tests/data/recorded/test_scan_vmap.npz), the same results on meshes, scan over remat, and clear
errors."""
import doctest
import functools
import importlib

import numpy as np
import pytest

import ctrainstate as cts
import ctrainstate.numpy as cnp
from ctrainstate import nn, random
from ctrainstate import partitioning as nn_partitioning
from ctrainstate.partitioning import AxisMetadata
from ctrainstate._src.nn import lifted as nn_lifted_impl
from ctrainstate.sharding import PartitionSpec as P


def _leaves_with_paths(tree):
    return [(cts.tree_util.keystr(p), x) for p, x in cts.tree_util.tree_leaves_with_path(tree)]


def _flax_leaves(jax, tree):
    """A flax tree as [(jax's key path, leaf)], what _assert_trees_close compares with."""
    return [(jax.tree_util.keystr(p), np.asarray(x))
            for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def _assert_trees_close(ours, theirs, rtol=1e-6, atol=1e-7):
    """ours (a ctrainstate tree) against theirs (_flax_leaves of flax's): the same key paths,
    shapes and values."""
    mine = _leaves_with_paths(ours)
    assert [p for p, _ in mine] == [p for p, _ in theirs]
    for (p, a), (_, b) in zip(mine, theirs):
        assert np.shape(a) == np.shape(b), p
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol, err_msg=p)


# --- the reference table: P9, P11, M5, M9 --------------------------------------------------------

def _sindot(N, P_, np_):
    class SinDot(N.Module):
        depth: int

        @N.compact
        def __call__(self, x):
            W1 = P_.param_with_axes('W1', N.initializers.xavier_normal(),
                                    (x.shape[-1], self.depth), axes=('emb', 'mlp'))
            W2 = P_.param_with_axes('W2', N.initializers.xavier_normal(),
                                    (self.depth, x.shape[-1]), axes=('mlp', 'emb'))
            y = np_.dot(np_.sin(np_.dot(x, W1)), W2) + x
            P_.variable_with_axes('stats', 'y_st', lambda: y, axes=('batch', 'emb'))
            return y, None

    class Scanned(N.Module):
        num_layers: int
        depth: int

        @N.compact
        def __call__(self, x):
            S = P_.scan_with_axes(SinDot, in_axes=(), variable_axes={'params': 0, 'stats': 1},
                                  split_rngs={'params': True}, axis_name='layer',
                                  axes_collections=('params', 'stats'), length=self.num_layers)
            x, _ = S(self.depth, name='scanned_layer')(x)
            x, _ = S(self.depth, name='scanned_layer2')(x)
            return x
    return Scanned


P9_RULES = (('emb', 'data'), ('mlp', 'model'), ('batch', 'data'))


def test_p9_scan_with_axes_sindot():
    B, L, E, D = 8, 4, 32, 64
    x = np.ones((B, E), np.float32)
    Scanned = _sindot(nn, nn_partitioning, cnp)
    with nn_partitioning.axis_rules(P9_RULES):
        v = Scanned(L, D).init(random.PRNGKey(0), x)
    assert set(v) == {'params', 'params_axes', 'stats', 'stats_axes'}
    assert v['params_axes']['scanned_layer']['W1_axes'] == \
        AxisMetadata(names=('layer', 'emb', 'mlp'))
    assert nn_partitioning.get_axis_names(v['params_axes']) == {
        'scanned_layer': {'W1': P('layer', 'emb', 'mlp'), 'W2': P('layer', 'mlp', 'emb')},
        'scanned_layer2': {'W1': P('layer', 'emb', 'mlp'), 'W2': P('layer', 'mlp', 'emb')}}
    assert nn_partitioning.get_axis_names(v['stats_axes']) == {
        'scanned_layer': {'y_st': P('batch', 'layer', 'emb')},
        'scanned_layer2': {'y_st': P('batch', 'layer', 'emb')}}
    assert v['params']['scanned_layer']['W1'].shape == (L, E, D)
    assert v['params']['scanned_layer']['W2'].shape == (L, D, E)
    assert v['stats']['scanned_layer']['y_st'].shape == (B, L, E)
    # apply with the axes collections immutable works, and is the layers applied in turn
    y = Scanned(L, D).apply(v, x)
    ref = x
    for name in ('scanned_layer', 'scanned_layer2'):
        for i in range(L):
            w1 = np.asarray(v['params'][name]['W1'])[i]
            w2 = np.asarray(v['params'][name]['W2'])[i]
            ref = np.sin(ref @ w1) @ w2 + ref
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)
    # the stats are each layer's output, stacked along axis 1
    st = np.asarray(v['stats']['scanned_layer']['y_st'])
    h = x
    for i in range(L):
        h = np.sin(h @ np.asarray(v['params']['scanned_layer']['W1'])[i]) @ \
            np.asarray(v['params']['scanned_layer']['W2'])[i] + h
        np.testing.assert_allclose(st[:, i], h, rtol=1e-5, atol=1e-5)


def _axis_names_as_tuples(axis_names):
    return {k: {n: tuple(s) for n, s in d.items()} for k, d in axis_names.items()}


def test_p9_matches_flax(jax_ref):
    x = np.ones((8, 32), np.float32)

    def flax_side(jax, jnp, fnn, fP):
        with fP.axis_rules(P9_RULES):
            fv = _sindot(fnn, fP, jnp)(4, 64).init(jax.random.PRNGKey(0), x)
        return {"params": _flax_leaves(jax, fv['params']), "stats": _flax_leaves(jax, fv['stats']),
                "axis_names": _axis_names_as_tuples(fP.get_axis_names(fv['params_axes']))}

    fv = jax_ref("flax", flax_side)
    with nn_partitioning.axis_rules(P9_RULES):
        v = _sindot(nn, nn_partitioning, cnp)(4, 64).init(random.PRNGKey(0), x)
    _assert_trees_close(v['params'], fv['params'])
    _assert_trees_close(v['stats'], fv['stats'], rtol=1e-5, atol=1e-5)
    assert _axis_names_as_tuples(nn_partitioning.get_axis_names(v['params_axes'])) == \
        fv['axis_names']
    # an unnamed instance gets Flax's auto name
    class Auto(nn.Module):
        @nn.compact
        def __call__(self, x):
            S = nn_partitioning.scan_with_axes(_plain_layer(nn), in_axes=(),
                                               variable_axes={'params': 0},
                                               split_rngs={'params': True}, length=2)
            return S(8)(x)[0]
    v = Auto().init(random.PRNGKey(0), np.ones((2, 4), np.float32))
    assert list(v['params']) == ['Map_variablesScanLayer_0']
    assert v['params']['Map_variablesScanLayer_0']['Dense_1']['kernel'].shape == (2, 4, 8)


def _plain_layer(N):
    class Layer(N.Module):
        depth: int

        @N.compact
        def __call__(self, x):
            return N.Dense(x.shape[-1])(N.relu(N.Dense(self.depth)(x))), None
    return Layer


def _foo(N, P_, np_):
    class Foo(N.Module):
        @N.compact
        def __call__(self, x):
            W = P_.param_with_axes('w', N.initializers.uniform(), [4, 3], axes=('out', 'in'))
            return W @ x
    return Foo


P11_RULES = (('out', None), ('in', 'data'), ('vmap_axis', 'model'))


def test_p10_p11_vmap_with_axes():
    Foo = _foo(nn, nn_partitioning, cnp)
    with nn_partitioning.axis_rules(P11_RULES):
        v = Foo().init(random.PRNGKey(0), np.array([1, 2, 3], np.float32))
    assert cts.tree_util.tree_map(np.shape, v) == {
        'params': {'w': (4, 3)}, 'params_axes': {'w_axes': AxisMetadata(names=('out', 'in'))}}
    V = nn_partitioning.vmap_with_axes(Foo, variable_axes={'params': 1},
                                       split_rngs={'params': True},
                                       partitioning_axis_names={'params': 'vmap_axis'})
    assert V.__name__ == 'Map_variablesVmapFoo'

    class Vmapped(nn.Module):
        @nn.compact
        def __call__(self, x):
            return V(name='foo_vmapped')(x)
    x = np.array([[1, 2, 3], [4, 5, 6]], np.float32)
    with nn_partitioning.axis_rules(P11_RULES):
        v = Vmapped().init(random.PRNGKey(0), x)
    assert cts.tree_util.tree_map(np.shape, v) == {
        'params': {'foo_vmapped': {'w': (4, 2, 3)}},
        'params_axes': {'foo_vmapped': {'w_axes': AxisMetadata(names=('out', 'vmap_axis', 'in'))}}}
    # apply maps element i of x with slice i of w
    y = Vmapped().apply(v, x)
    w = np.asarray(v['params']['foo_vmapped']['w'])
    np.testing.assert_allclose(np.asarray(y), np.stack([w[:, i] @ x[i] for i in range(2)]),
                               rtol=1e-6)


def test_p11_matches_flax(jax_ref):
    x = np.array([[1, 2, 3], [4, 5, 6]], np.float32)
    kw = dict(variable_axes={'params': 1}, split_rngs={'params': True},
              partitioning_axis_names={'params': 'vmap_axis'})

    def flax_side(jax, jnp, fnn, fP):
        with fP.axis_rules(P11_RULES):
            FV = fP.vmap_with_axes(_foo(fnn, fP, jnp), **kw)
            fv = FV(name='foo_vmapped').init(jax.random.PRNGKey(3), x)
            fy = FV(name='foo_vmapped').apply(fv, x)
        return {"params": _flax_leaves(jax, fv['params']), "y": fy}

    want = jax_ref("flax", flax_side)
    with nn_partitioning.axis_rules(P11_RULES):
        CV = nn_partitioning.vmap_with_axes(_foo(nn, nn_partitioning, cnp), **kw)
        v = CV(name='foo_vmapped').init(random.PRNGKey(3), x)
        y = CV(name='foo_vmapped').apply(v, x)
    _assert_trees_close(v['params'], want['params'])
    np.testing.assert_allclose(np.asarray(y), want['y'], rtol=1e-6)


def _boxed_dense(N, np_):
    class Body(N.Module):
        @N.compact
        def __call__(self, c, _):
            k = self.param('kernel', N.with_partitioning(N.initializers.ones, ('in', 'out')),
                           (c.shape[-1], 3))
            b = self.param('bias', N.initializers.zeros, (3,))
            return np_.dot(c, k) + b, None
    return Body


def test_m5_scan_metadata_params_partition_name():
    S = nn.scan(_boxed_dense(nn, cnp), variable_axes={'params': 0}, split_rngs={'params': True},
                length=8, metadata_params={nn.PARTITION_NAME: 'layers'})
    v = S().init(random.PRNGKey(0), np.zeros((8, 3), np.float32), None)
    k = v['params']['kernel']
    assert isinstance(k, nn.Partitioned) and k.names == ('layers', 'in', 'out')
    assert k.value.shape == (8, 3, 3) and v['params']['bias'].shape == (8, 3)
    assert nn.get_partition_spec(v['params']) == {'kernel': P('layers', 'in', 'out'),
                                                  'bias': P()}
    # on the way in the axis is removed again (and checked): apply works
    out, _ = S().apply(v, np.ones((8, 3), np.float32), None)
    np.testing.assert_allclose(np.asarray(out), np.full((8, 3), 3.0 ** 8), rtol=1e-6)
    # no partition name: Flax's PartitioningUnspecifiedError
    S2 = nn.scan(_boxed_dense(nn, cnp), variable_axes={'params': 0}, split_rngs={'params': True},
                 length=2)
    with pytest.raises(nn.meta.PartitioningUnspecifiedError):
        S2().init(random.PRNGKey(0), np.zeros((8, 3), np.float32), None)


def test_m1_vmap_metadata_params():
    class Bar(nn.Module):
        @nn.compact
        def __call__(self, x):
            k = self.param('kernel', nn.with_partitioning(nn.initializers.ones, ('in', 'out')),
                           (x.shape[-1], 2))
            stored = self.scope.get_variable('params', 'kernel')
            assert isinstance(stored, nn.Partitioned) and stored.names == ('in', 'out')
            return cnp.dot(x, k)

    class Foo(nn.Module):
        @nn.compact
        def __call__(self, xs):
            return nn.vmap(Bar, variable_axes={'params': 0}, split_rngs={'params': True},
                           metadata_params={nn.PARTITION_NAME: 'batch'})(name='bar')(xs)

    v = Foo().init(random.PRNGKey(0), np.zeros((8, 3), np.float32))
    k = v['params']['bar']['kernel']
    assert isinstance(k, nn.Partitioned) and k.names == ('batch', 'in', 'out')
    assert k.value.shape == (8, 3, 2)
    y = Foo().apply(v, np.ones((8, 3), np.float32))
    np.testing.assert_array_equal(np.asarray(y), np.full((8, 2), 3.0))


def test_m9_dot_relu_dot_scan_specs_and_sharded_apply():
    class DotReluDot(nn.Module):
        depth: int

        @nn.compact
        def __call__(self, x, _):
            y = nn.Dense(self.depth, use_bias=False, kernel_init=nn.with_partitioning(
                nn.initializers.xavier_normal(), (None, 'model')))(x)
            y = nn.relu(y)
            W2 = self.param('W2', nn.with_partitioning(nn.initializers.xavier_normal(),
                                                       ('model', None)), (self.depth, x.shape[-1]))
            return cnp.dot(y, W2), None

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x, _ = nn.scan(DotReluDot, length=4, variable_axes={'params': 0},
                           split_rngs={'params': True},
                           metadata_params={nn.PARTITION_NAME: None})(32)(x, None)
            return x

    x = np.ones((8, 16), np.float32)
    ref = MLP().init(random.PRNGKey(0), x)
    assert nn.get_partition_spec(ref) == {'params': {'ScanDotReluDot_0': {
        'Dense_0': {'kernel': P(None, None, 'model')}, 'W2': P(None, 'model', None)}}}
    mesh = cts.make_mesh((2, 4), ('data', 'model'))
    with mesh:
        v = MLP().init(random.PRNGKey(0), x)
        k = v['params']['ScanDotReluDot_0']['Dense_0']['kernel'].value
        assert k.sharding.spec == P(None, None, 'model')  # born sharded, with the scan axis
        y = MLP().apply(v, x)
    np.testing.assert_array_equal(np.asarray(k), np.asarray(
        ref['params']['ScanDotReluDot_0']['Dense_0']['kernel'].value))
    np.testing.assert_allclose(np.asarray(y), np.asarray(MLP().apply(ref, x)), rtol=1e-5)


# --- parity with flax.linen: scan -----------------------------------------------------------------

def _scan_model(N, np_, *, reverse=False, axis=0, act='gelu'):
    class Block(N.Module):
        hidden: int

        @N.compact
        def __call__(self, c, x, scale):
            h = N.Dense(self.hidden)(np_.concatenate([c, x], axis=-1))
            h = getattr(N, act)(h)
            h = N.Dropout(0.3, deterministic=False)(h)
            self.sow('intermediates', 'h', h)
            h = N.Dense(c.shape[-1])(h) * scale
            return N.tanh(c + h), h[:, :2]

    class Net(N.Module):
        @N.compact
        def __call__(self, c, xs, scale):
            S = N.scan(Block, variable_axes={'params': axis, 'intermediates': 0},
                       split_rngs={'params': True, 'dropout': True},
                       in_axes=(1, N.broadcast), out_axes=1, reverse=reverse)
            c, ys = S(16)(c, xs, scale)
            return N.Dense(2)(c), ys
    return Net, Block


def _scan_data():
    rng = np.random.default_rng(0)
    c = rng.standard_normal((4, 6)).astype(np.float32)
    xs = rng.standard_normal((4, 5, 3)).astype(np.float32)  # scanned along axis 1 (5 steps)
    scale = np.float32(0.7) * np.ones((1, 6), np.float32)
    return c, xs, scale


@pytest.mark.parametrize("reverse,axis,act", [(False, 0, 'gelu'), (True, 1, 'softmax')])
def test_scan_matches_flax_init_apply_and_grads(reverse, axis, act, jax_ref):
    """gelu: the first trace runs abstractly; softmax has no shape rule, so it runs on step
    0's values (and later calls go there directly): the same values either way."""
    c, xs, scale = _scan_data()

    def flax_side(jax, jnp, fnn):
        FNet = _scan_model(fnn, jnp, reverse=reverse, axis=axis, act=act)[0]
        fv = FNet().init({'params': jax.random.PRNGKey(0), 'dropout': jax.random.PRNGKey(1)},
                         c, xs, scale)
        (fo, fys), fst = FNet().apply(fv, c, xs, scale, rngs={'dropout': jax.random.PRNGKey(5)},
                                     mutable=['intermediates'])

        def floss(p, xs):
            o, ys = FNet().apply({'params': p}, c, xs, scale,
                                 rngs={'dropout': jax.random.PRNGKey(5)})
            return jnp.sum(jnp.square(o)) + jnp.sum(jnp.sin(ys))

        fl, fg = jax.value_and_grad(floss, argnums=(0, 1))(fv['params'], xs)
        return {"v": _flax_leaves(jax, fv), "o": fo, "ys": fys, "st": _flax_leaves(jax, fst),
                "loss": float(fl), "grad_params": _flax_leaves(jax, fg[0]), "grad_xs": fg[1]}

    want = jax_ref("flax", flax_side)
    CNet, CBlock = _scan_model(nn, cnp, reverse=reverse, axis=axis, act=act)
    v = CNet().init({'params': random.PRNGKey(0), 'dropout': random.PRNGKey(1)}, c, xs, scale)
    assert sorted(v['params']) == ['Dense_0', 'ScanBlock_0']
    k = v['params']['ScanBlock_0']['Dense_0']['kernel']
    assert k.shape == ((5, 9, 16) if axis == 0 else (9, 5, 16))
    _assert_trees_close(v, want['v'])
    assert nn_lifted_impl._MEMO[CBlock]['__call__'].get('concrete', False) == (act == 'softmax')

    (o, ys), st = CNet().apply(v, c, xs, scale, rngs={'dropout': random.PRNGKey(5)},
                               mutable=['intermediates'])
    assert ys.shape == (4, 5, 2)
    np.testing.assert_allclose(np.asarray(o), want['o'], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ys), want['ys'], rtol=1e-5, atol=1e-6)
    _assert_trees_close(st, want['st'], rtol=1e-5, atol=1e-6)

    def closs(p, xs):
        o, ys = CNet().apply({'params': p}, c, xs, scale, rngs={'dropout': random.PRNGKey(5)})
        return cnp.sum(cnp.square(o)) + cnp.sum(cnp.sin(ys))

    cl, cg = cts.value_and_grad(closs, argnums=(0, 1))(v['params'], xs)
    np.testing.assert_allclose(float(cl), want['loss'], rtol=1e-5)
    _assert_trees_close(cg[0], want['grad_params'], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(cg[1]), want['grad_xs'], rtol=1e-4, atol=1e-5)


def test_scan_broadcast_params_carry_collection_and_second_call_match_flax(jax_ref):
    """Shared (broadcast) params made by the first trace with the unsplit key, a carried
    counter, a stream not named by split_rngs (falls back to 'params'), and one scanned module
    called twice (its RNG counters keep counting)."""
    def model(N, np_):
        class Cell(N.Module):
            @N.compact
            def __call__(self, c, x):
                k = 1.0
                if self.has_variable('counter', 'n'):  # carried: it exists before the loop
                    n = self.variable('counter', 'n', lambda: np_.zeros((), np_.float32))
                    n.value = n.value + 1.0
                    k = n.value
                h = N.tanh(N.Dense(c.shape[-1])(c) + N.Dense(c.shape[-1], use_bias=False)(x))
                h = N.Dropout(0.5, deterministic=False)(h)
                return h, h.sum(axis=-1) * k

        class Net(N.Module):
            @N.compact
            def __call__(self, c, xs):
                S = N.scan(Cell, variable_broadcast='params', variable_carry='counter',
                           split_rngs={'params': False}, in_axes=0, out_axes=0)
                cell = S()
                c, ys1 = cell(c, xs)
                c, ys2 = cell(c, xs)
                return c, ys1, ys2
        return Net

    rng = np.random.default_rng(1)
    c = rng.standard_normal((2, 4)).astype(np.float32)
    xs = rng.standard_normal((3, 2, 5)).astype(np.float32)
    counter = {'ScanCell_0': {'n': np.zeros((), np.float32)}}

    def flax_side(jax, jnp, fnn):
        fo, fv = model(fnn, jnp)().init_with_output(
            {'params': jax.random.PRNGKey(2), 'dropout': jax.random.PRNGKey(3)}, c, xs)
        fo2, fst = model(fnn, jnp)().apply({**fv, 'counter': counter}, c, xs,
                                          rngs={'params': jax.random.PRNGKey(9)},
                                          mutable=['counter'])
        return {"o": fo, "v": _flax_leaves(jax, fv), "o2": fo2,
                "n": float(np.asarray(fst['counter']['ScanCell_0']['n']))}

    want = jax_ref("flax", flax_side)
    o, v = model(nn, cnp)().init_with_output(
        {'params': random.PRNGKey(2), 'dropout': random.PRNGKey(3)}, c, xs)
    assert v['params']['ScanCell_0']['Dense_0']['kernel'].shape == (4, 4)  # not stacked
    _assert_trees_close(v, want['v'], rtol=1e-6, atol=1e-6)
    for a, b in zip(o, want['o'], strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)
    o2, st = model(nn, cnp)().apply({**v, 'counter': counter}, c, xs,
                                    rngs={'params': random.PRNGKey(9)}, mutable=['counter'])
    assert float(np.asarray(st['counter']['ScanCell_0']['n'])) == 6.0
    assert want['n'] == 6.0
    for a, b in zip(o2, want['o2'], strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)


def test_scan_carried_variable_created_inside_raises():
    class Cell(nn.Module):
        @nn.compact
        def __call__(self, c, x):
            n = self.variable('counter', 'n', lambda: np.zeros((), np.float32))
            n.value = n.value + 1.0
            return c, None
    S = nn.scan(Cell, variable_carry='counter', length=2)
    with pytest.raises(TypeError, match="carried collection 'counter' changed its variables"):
        S().init(random.PRNGKey(0), np.zeros(2, np.float32), None)


def test_nested_scan_with_scan_out_matches_flax(jax_ref):
    def model(N, P_):
        class Inner(N.Module):
            @N.compact
            def __call__(self, c, x):
                h = N.Dropout(0.5, deterministic=False)(N.Dense(3)(c) + x)
                self.sow('intermediates', 'h', h)
                return N.tanh(h), None

        class Mid(N.Module):
            @N.compact
            def __call__(self, c, x):
                S = N.scan(Inner, variable_axes={'params': 0, 'intermediates': P_.ScanOut(0)},
                           split_rngs={'params': True, 'dropout': True}, in_axes=N.broadcast,
                           length=2)
                c, _ = S()(c, x)
                return N.Dense(3)(c), None

        class Outer(N.Module):
            @N.compact
            def __call__(self, c, xs):
                S = N.scan(Mid, variable_axes={'params': 0, 'intermediates': 0},
                           split_rngs={'params': True, 'dropout': True})
                return S()(c, xs)[0]
        return Outer

    c = np.ones((2, 3), np.float32)
    xs = np.linspace(0, 1, 18, dtype=np.float32).reshape(3, 2, 3)

    def flax_side(jax, fnn, fP):
        fo, fv = model(fnn, fP)().init_with_output(
            {'params': jax.random.PRNGKey(0), 'dropout': jax.random.PRNGKey(1)}, c, xs,
            mutable=True)
        return {"o": fo, "v": _flax_leaves(jax, fv)}

    want = jax_ref("flax", flax_side)
    o, v = model(nn, nn_partitioning)().init_with_output(
        {'params': random.PRNGKey(0), 'dropout': random.PRNGKey(1)}, c, xs, mutable=True)
    assert v['params']['ScanMid_0']['ScanInner_0']['Dense_0']['kernel'].shape == (3, 2, 3, 3)
    assert v['intermediates']['ScanMid_0']['ScanInner_0']['h'][0].shape == (3, 2, 2, 3)
    _assert_trees_close(v, want['v'], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(o), want['o'], rtol=1e-6, atol=1e-6)


def test_scan_without_constancy_trace_matches_flax(jax_ref):
    """check_constancy_invariants=False: Flax traces the body once, so its counters (and the
    keys) differ from the default's; ctrainstate follows."""

    def scanned(N, **kw):
        class Block(N.Module):
            @N.compact
            def __call__(self, c, x):
                h = N.Dropout(0.5, deterministic=False)(N.Dense(3)(c) + x)
                return N.tanh(h), h
        return N.scan(Block, variable_axes={'params': 0},
                      split_rngs={'params': True, 'dropout': True}, **kw)

    c = np.ones((2, 3), np.float32)
    xs = np.linspace(0, 1, 18, dtype=np.float32).reshape(3, 2, 3)

    def flax_side(jax, fnn):
        fo, fv = scanned(fnn, check_constancy_invariants=False)().init_with_output(
            {'params': jax.random.PRNGKey(0), 'dropout': jax.random.PRNGKey(1)}, c, xs)
        return {"ys": fo[1], "v": _flax_leaves(jax, fv)}

    want = jax_ref("flax", flax_side)
    o, v = scanned(nn, check_constancy_invariants=False)().init_with_output(
        {'params': random.PRNGKey(0), 'dropout': random.PRNGKey(1)}, c, xs)
    _assert_trees_close(v, want['v'])
    np.testing.assert_allclose(np.asarray(o[1]), want['ys'], rtol=1e-6, atol=1e-6)
    v_default = scanned(nn)().init({'params': random.PRNGKey(0), 'dropout': random.PRNGKey(1)},
                                   c, xs)
    assert not np.array_equal(np.asarray(v['params']['Dense_0']['kernel']),
                              np.asarray(v_default['params']['Dense_0']['kernel']))
    with pytest.raises(ValueError, match="does not support broadcast non-carry function "
                                         "outputs"):
        scanned(nn, check_constancy_invariants=False, out_axes=nn.broadcast)().init(
            random.PRNGKey(0), c, xs)


# --- parity with flax.linen: vmap -----------------------------------------------------------------

def _vmap_model(N, np_, shared: bool):
    class Head(N.Module):
        @N.compact
        def __call__(self, x, bias):
            h = N.Dense(8)(x)
            h = N.Dropout(0.25, deterministic=False)(h)
            return N.Dense(3)(N.relu(h)) + bias

    class Net(N.Module):
        @N.compact
        def __call__(self, x, bias):
            V = N.vmap(Head, variable_axes={'params': None if shared else 0},
                       split_rngs={'params': not shared, 'dropout': True},
                       in_axes=(1, None), out_axes=1)
            return V()(x, bias)
    return Net


@pytest.mark.parametrize("shared", [False, True])
def test_vmap_matches_flax_init_apply_and_grads(shared, jax_ref):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 4, 6)).astype(np.float32)  # mapped along axis 1
    bias = rng.standard_normal((3,)).astype(np.float32)

    def flax_side(jax, jnp, fnn):
        FNet = _vmap_model(fnn, jnp, shared)
        fv = FNet().init({'params': jax.random.PRNGKey(0), 'dropout': jax.random.PRNGKey(1)},
                         x, bias)

        def floss(p, x):
            y = FNet().apply({'params': p}, x, bias, rngs={'dropout': jax.random.PRNGKey(4)})
            return jnp.sum(jnp.square(y)), y

        (fl, fy), fg = jax.value_and_grad(floss, argnums=(0, 1), has_aux=True)(fv['params'], x)
        return {"v": _flax_leaves(jax, fv), "y": fy, "loss": float(fl),
                "grad_params": _flax_leaves(jax, fg[0]), "grad_x": fg[1]}

    want = jax_ref("flax", flax_side)
    CNet = _vmap_model(nn, cnp, shared)
    v = CNet().init({'params': random.PRNGKey(0), 'dropout': random.PRNGKey(1)}, x, bias)
    assert list(v['params']) == ['VmapHead_0']
    kshape = v['params']['VmapHead_0']['Dense_0']['kernel'].shape
    assert kshape == ((6, 8) if shared else (4, 6, 8))
    _assert_trees_close(v, want['v'])

    def closs(p, x):
        y = CNet().apply({'params': p}, x, bias, rngs={'dropout': random.PRNGKey(4)})
        return cnp.sum(cnp.square(y)), y

    (cl, y), cg = cts.value_and_grad(closs, argnums=(0, 1), has_aux=True)(v['params'], x)
    assert y.shape == (5, 4, 3)
    np.testing.assert_allclose(np.asarray(y), want['y'], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(cl), want['loss'], rtol=1e-5)
    _assert_trees_close(cg[0], want['grad_params'], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(cg[1]), want['grad_x'], rtol=1e-4, atol=1e-5)


# --- meshes ---------------------------------------------------------------------------------------

def _t5x_stack(remat: bool, counter=None):
    class BlockLayer(nn.Module):
        @nn.compact
        def __call__(self, x, deterministic):
            if counter is not None:
                counter.append(1)
            wi = nn_partitioning.param_with_axes('wi', nn.initializers.lecun_normal(), (8, 16),
                                                 axes=('embed', 'mlp'))
            wo = nn_partitioning.param_with_axes('wo', nn.initializers.lecun_normal(), (16, 8),
                                                 axes=('mlp', 'embed'))
            h = nn.gelu(cnp.dot(x, wi))
            h = nn.Dropout(0.2)(h, deterministic=deterministic)
            h = nn_partitioning.with_sharding_constraint(h, ('batch', 'mlp'))
            return x + cnp.dot(h, wo), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x, deterministic=False):
            layer = nn_partitioning.remat(BlockLayer, static_argnums=(1,)) if remat else BlockLayer
            S = nn_partitioning.scan_with_axes(
                layer, variable_axes={'params': 0}, split_rngs={'params': True, 'dropout': True},
                in_axes=(nn.broadcast,), length=4, axis_name='layers')
            x, _ = S(name='layers')(x, deterministic)
            return x
    return Stack


RULES = (('batch', 'data'), ('embed', None), ('mlp', 'model'), ('layers', None))


def _loss_fn(Stack, x):
    def loss(p):
        y = Stack().apply({'params': p}, x, rngs={'dropout': random.PRNGKey(3)})
        return cnp.mean(cnp.square(y))
    return loss


@pytest.mark.parametrize("mesh_shape,names,layer_rule", [
    ((8,), ('model',), None), ((2, 4), ('data', 'model'), None),
    ((2, 4), ('data', 'model'), 'data')])
def test_sharded_scan_equals_single_device(mesh_shape, names, layer_rule):
    Stack = _t5x_stack(remat=False)
    x = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    ref = Stack().init({'params': random.PRNGKey(0), 'dropout': random.PRNGKey(1)}, x)
    ref_l, ref_g = cts.value_and_grad(_loss_fn(Stack, x))(ref['params'])
    rules = tuple((k, a if a in names else None) for k, a in RULES[:-1]) + \
        (('layers', layer_rule),)
    mesh = cts.make_mesh(mesh_shape, names)
    with mesh, nn_partitioning.axis_rules(rules):
        v = Stack().init({'params': random.PRNGKey(0), 'dropout': random.PRNGKey(1)}, x)
        wi = v['params']['layers']['wi']
        want = nn.logical_to_mesh_axes(('layers', 'embed', 'mlp'))
        assert wi.sharding.is_equivalent_to(cts.NamedSharding(mesh, want), 3)
        l, g = cts.value_and_grad(_loss_fn(Stack, x))(v['params'])
    assert v['params_axes']['layers']['wi_axes'] == AxisMetadata(('layers', 'embed', 'mlp'))
    for a, b in zip(cts.tree_util.tree_leaves(v['params']),
                    cts.tree_util.tree_leaves(ref['params'])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the same bits on any mesh
    np.testing.assert_allclose(float(l), float(ref_l), rtol=1e-6)
    for a, b in zip(cts.tree_util.tree_leaves(g), cts.tree_util.tree_leaves(ref_g)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert g['layers']['wi'].sharding.is_equivalent_to(wi.sharding, 3)


def test_scan_over_remat_t5x_pattern():
    calls = []
    Plain, Remat = _t5x_stack(remat=False), _t5x_stack(remat=True, counter=calls)
    assert nn_partitioning.remat(nn.Dense).__name__ == 'Core_remat_staticDense'
    x = np.random.default_rng(5).standard_normal((4, 8)).astype(np.float32)
    rngs = {'params': random.PRNGKey(0), 'dropout': random.PRNGKey(1)}
    v0 = Plain().init(rngs, x)
    v1 = Remat().init(rngs, x)
    assert cts.tree_util.tree_map(np.shape, v0) == cts.tree_util.tree_map(np.shape, v1)
    for a, b in zip(cts.tree_util.tree_leaves(v0), cts.tree_util.tree_leaves(v1)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    calls.clear()
    l0, g0 = cts.value_and_grad(_loss_fn(Plain, x))(v0['params'])
    l1, g1 = cts.value_and_grad(_loss_fn(Remat, x))(v1['params'])
    # forward: 4 layers + the first (abstract) trace; backward: each layer runs again
    assert len(calls) == 4 + 1 + 4
    assert float(l0) == float(l1)
    for a, b in zip(cts.tree_util.tree_leaves(g0), cts.tree_util.tree_leaves(g1)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_remat_around_scan_same_bits():
    """nn.remat of a module holding a scan, called twice through one instance: the backward
    pass runs the scan again with the RNG counters it had (dropout keys replayed)."""
    class Block(nn.Module):
        @nn.compact
        def __call__(self, c, x):
            h = nn.Dropout(0.5, deterministic=False)(nn.Dense(4)(c) + x)
            return nn.tanh(h), h

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, c, xs):
            c, ys = nn.scan(Block, variable_axes={'params': 0},
                            split_rngs={'params': True, 'dropout': True})()(c, xs)
            return cnp.sum(ys) + cnp.sum(nn.Dropout(0.5, deterministic=False)(c))

    class CheckpointStack(Stack):  # nn.remat(Stack)'s name, without remat
        pass

    def net(remat):
        class Net(nn.Module):
            @nn.compact
            def __call__(self, c, xs):
                S = nn.remat(Stack) if remat else CheckpointStack
                s = S()
                return S()(c, xs) + s(c, xs) + s(c, xs)
        return Net

    c = np.ones((2, 4), np.float32)
    xs = np.linspace(0, 1, 24, dtype=np.float32).reshape(3, 2, 4)
    rngs = {'params': random.PRNGKey(0), 'dropout': random.PRNGKey(1)}
    v0, v1 = net(False)().init(rngs, c, xs), net(True)().init(rngs, c, xs)
    assert sorted(v1['params']) == ['CheckpointStack_0', 'CheckpointStack_1']
    for a, b in zip(cts.tree_util.tree_leaves(v0), cts.tree_util.tree_leaves(v1)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def vg(N, v):
        return cts.value_and_grad(lambda p: N().apply({'params': p}, c, xs,
                                                      rngs={'dropout': random.PRNGKey(5)}))(v)
    l0, g0 = vg(net(False), v0['params'])
    l1, g1 = vg(net(True), v1['params'])
    assert float(l0) == float(l1)
    for a, b in zip(cts.tree_util.tree_leaves(g0), cts.tree_util.tree_leaves(g1)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_scan_over_remat_matches_flax(jax_ref):
    """t5x's scalable_t5 pattern: remat(BlockLayer) scanned with the params' layer axis at
    position 1, lifted as ScanIn(1) (input only) once the params exist."""
    def model(N, P_, np_):
        class BlockLayer(N.Module):
            @N.compact
            def __call__(self, x, deterministic):
                wi = P_.param_with_axes('wi', N.initializers.lecun_normal(), (x.shape[-1], 12),
                                        axes=('embed', 'mlp'))
                h = N.Dropout(0.2)(np_.dot(x, wi), deterministic=deterministic)
                return x + N.Dense(x.shape[-1])(N.gelu(h)), None

        class Stack(N.Module):
            @N.compact
            def __call__(self, x, deterministic=False):
                spec = 1 if self.is_mutable_collection('params') else P_.ScanIn(1)
                S = P_.scan_with_axes(P_.remat(BlockLayer, static_argnums=(1,)),
                                      variable_axes={'params': spec},
                                      split_rngs={'params': True, 'dropout': True},
                                      in_axes=(N.broadcast,), length=3)
                return S(name='layers')(x, deterministic)[0]
        return Stack

    x = np.random.default_rng(6).standard_normal((2, 5)).astype(np.float32)

    def flax_side(jax, jnp, fnn, fP):
        FS = model(fnn, fP, jnp)
        fv = FS().init({'params': jax.random.PRNGKey(0), 'dropout': jax.random.PRNGKey(1)}, x)
        fl, fg = jax.value_and_grad(lambda p: jnp.sum(FS().apply(
            {'params': p, 'params_axes': fv['params_axes']}, x,
            rngs={'dropout': jax.random.PRNGKey(2)}) ** 2))(fv['params'])
        return {"params": _flax_leaves(jax, fv['params']), "loss": float(fl),
                "grads": _flax_leaves(jax, fg)}

    want = jax_ref("flax", flax_side)
    CS = model(nn, nn_partitioning, cnp)
    v = CS().init({'params': random.PRNGKey(0), 'dropout': random.PRNGKey(1)}, x)
    assert v['params']['layers']['wi'].shape == (5, 3, 12)
    assert v['params_axes']['layers']['wi_axes'] == AxisMetadata(('embed', 'layers', 'mlp'))
    _assert_trees_close(v['params'], want['params'])
    axes = v['params_axes']
    cl, cg = cts.value_and_grad(lambda p: cnp.sum(cnp.square(CS().apply(
        {'params': p, 'params_axes': axes}, x, rngs={'dropout': random.PRNGKey(2)}))))(v['params'])
    np.testing.assert_allclose(float(cl), want['loss'], rtol=1e-5)
    _assert_trees_close(cg, want['grads'], rtol=1e-4, atol=1e-5)


def test_data_transform_sees_flax_groups():
    seen = []

    def double_params(variable_groups, rng_groups):
        seen.append((len(variable_groups), [sorted(g) for g in rng_groups]))
        bcast, carry, scanned = variable_groups
        if 'params' in scanned:  # not at init: the params are made inside
            scanned = {'params': cts.tree_util.tree_map(lambda w: w * 2.0, scanned['params'])}
        return (bcast, carry, scanned), rng_groups

    kw = dict(variable_axes={'params': 0}, split_rngs={'params': True, 'dropout': False},
              length=3, in_axes=())
    Plain = nn.scan(_plain_layer(nn), **kw)
    Doubled = nn.scan(_plain_layer(nn), data_transform=double_params, **kw)
    x = np.ones((2, 4), np.float32)
    v = Plain(6).init(random.PRNGKey(0), x)
    v2 = Doubled(6).init(random.PRNGKey(0), x)
    for a, b in zip(cts.tree_util.tree_leaves(v), cts.tree_util.tree_leaves(v2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # init: nothing to double
    seen.clear()
    out, _ = Doubled(6).apply(v, x, rngs={'dropout': random.PRNGKey(1)})
    twice = cts.tree_util.tree_map(lambda w: np.asarray(w) * 2.0, v)
    ref, _ = Plain(6).apply(twice, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6)
    assert seen == [(3, [[], ['dropout']])] * 4  # the first trace and 3 steps; no 'params' key


# --- errors and small semantics -------------------------------------------------------------------

class _Add(nn.Module):
    @nn.compact
    def __call__(self, c, x):
        return c + x, x


def test_scan_length_errors():
    c = np.zeros((2,), np.float32)
    with pytest.raises(ValueError, match=r"^Inconsistent scan lengths: \{3, 4\}$"):
        _call(nn.scan(_AddTwo, in_axes=(0, 0)), c, np.zeros((3, 2), np.float32),
              np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError, match=r"^length should be specified manually\.$"):
        _call(nn.scan(_AddTwo, in_axes=(nn.broadcast, nn.broadcast)), c, c, c)
    with pytest.raises(ValueError, match="length=5 disagrees"):
        _call(nn.scan(_Add, length=5), c, np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match="has size 2 along axis 0, but the transform's length "
                                         "is 3"):
        _call(nn.scan(_AddTwo, in_axes=0), c, np.zeros((3, 2), np.float32),
              (np.zeros((3, 2), np.float32), np.zeros((2, 2), np.float32)))
    # the carry must keep its shape
    class Grow(nn.Module):
        @nn.compact
        def __call__(self, c, x):
            return cnp.concatenate([c, x]), None
    with pytest.raises(TypeError, match="carry must keep its shapes"):
        _call(nn.scan(Grow), c, np.zeros((3, 1), np.float32))
    with pytest.raises(TypeError, match="expected a Module class"):
        nn.scan("Block")        # (a function of a module is Flax's function form: lifted)


class _AddTwo(nn.Module):
    @nn.compact
    def __call__(self, c, x, y):
        return c, cts.tree_util.tree_map(lambda a: a, (x, y))


def _call(cls, *args):
    return cls().init(random.PRNGKey(0), *args)


def test_vmap_size_errors():
    class F(nn.Module):
        @nn.compact
        def __call__(self, x, y):
            return x
    V = nn.vmap(F, in_axes=(0, 0), variable_axes={'params': 0}, split_rngs={'params': True})
    with pytest.raises(ValueError, match=r"^Inconsistent batch axis sizes: \{2, 3\}$"):
        V().init(random.PRNGKey(0), np.zeros((2, 4)), np.zeros((3, 4)))
    # in_axes=0 sizes the map by the first leaf (as Flax does); the others are checked
    V = nn.vmap(F, variable_axes={'params': 0}, split_rngs={'params': True})
    with pytest.raises(ValueError, match="has size 3 along axis 0, but the transform's length "
                                         "is 2"):
        V().init(random.PRNGKey(0), np.zeros((2, 4)), np.zeros((3, 4)))
    V = nn.vmap(F, in_axes=None, variable_axes={'params': 0}, split_rngs={'params': True})
    with pytest.raises(ValueError, match=r"^axis_size should be specified manually\.$"):
        V().init(random.PRNGKey(0), np.zeros((2, 4)), np.zeros((3, 4)))
    v = nn.vmap(F, in_axes=None, axis_size=3, variable_axes={'params': 0},
                split_rngs={'params': True})().init(random.PRNGKey(0), np.zeros(2), np.zeros(2))
    assert v == {}


def test_scan_with_axes_wrong_axis_in_metadata():
    Stack = _t5x_stack(remat=False)
    x = np.ones((4, 8), np.float32)
    v = Stack().init({'params': random.PRNGKey(0), 'dropout': random.PRNGKey(1)}, x)
    bad = dict(v)
    bad['params_axes'] = {'layers': {'wi_axes': AxisMetadata(('embed', 'layers', 'mlp')),
                                     'wo_axes': v['params_axes']['layers']['wo_axes']}}
    with pytest.raises(ValueError, match=r"^Expected axis layers at position 0 in axis metadata "
                                         r"\['embed', 'layers', 'mlp'\]\.$"):
        Stack().apply(bad, x, True, mutable=['params_axes'])
    # immutable axes are checked as well, and left as they were
    with pytest.raises(ValueError, match="Expected axis layers at position 0"):
        Stack().apply(bad, x, True)
    assert bad['params_axes']['layers']['wi_axes'].names == ('embed', 'layers', 'mlp')


def test_kwargs_are_ignored_with_flax_warning_and_names():
    class K(nn.Module):
        @nn.compact
        def __call__(self, c, x, flag=False):
            return c + (100.0 if flag else 1.0), None
    S = nn.scan(K, length=3)
    assert S.__name__ == 'ScanK' and issubclass(S, K)
    assert nn.vmap(K).__name__ == 'VmapK'
    with pytest.warns(RuntimeWarning, match='kwargs are not supported in scan, so "flag" '
                                            r'is\(are\) ignored'):
        (out, _), _ = S().init_with_output(random.PRNGKey(0), np.zeros((), np.float32), None,
                                            flag=True)
    assert float(np.asarray(out)) == 3.0
    # methods=: another method is scanned, __call__ is left alone
    class M(nn.Module):
        def step(self, c, x):
            return c * 2.0, x

        def __call__(self, x):
            return x
    SM = nn.scan(M, methods=['step'], length=2)
    out, _ = SM().apply({}, np.ones(2, np.float32), None, method='step')
    np.testing.assert_array_equal(np.asarray(out), [4.0, 4.0])


def test_scan_under_eval_shape():
    Stack = _t5x_stack(remat=False)
    shapes = cts.eval_shape(Stack().init, {'params': random.PRNGKey(0),
                                            'dropout': random.PRNGKey(1)}, np.ones((4, 8),
                                                                                   np.float32))
    assert shapes['params']['layers']['wi'].shape == (4, 8, 16)
    assert shapes['params_axes']['layers']['wi_axes'] == AxisMetadata(('layers', 'embed', 'mlp'))


@pytest.mark.parametrize("name", ["ctrainstate.nn.lifted", "ctrainstate._src.nn.lifted",
                                  "ctrainstate._src.partitioning.lifted",
                                  "ctrainstate.nn.stochastic"])
def test_doctests(name):
    res = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0


# --- the function (decorator) form: nn.scan(body)(module, ...), @partial(nn.scan, ...) ----------

def _fn_models(N):
    class Cell(N.Module):
        @N.compact
        def __call__(self, c, x):
            h = N.tanh(N.Dense(3, name="hh")(c) + N.Dense(3, name="xh")(x))
            return h, h * 2.0

    def body(cell, c, x):
        return cell(c, x)

    class FnRNN(N.Module):      # the lifted function scans over the cell's own variables
        @N.compact
        def __call__(self, c, xs):
            scan = N.scan(body, variable_broadcast="params", split_rngs={"params": False},
                          in_axes=1, out_axes=1)
            return scan(Cell(), c, xs)

    class ClassRNN(N.Module):   # the same model through the class form
        @N.compact
        def __call__(self, c, xs):
            return N.scan(Cell, variable_broadcast="params", split_rngs={"params": False},
                          in_axes=1, out_axes=1)(name="Cell_0")(c, xs)

    class Deco(N.Module):       # a method decorated with functools.partial(nn.scan, ...)
        @functools.partial(N.scan, variable_axes={"params": 0}, split_rngs={"params": True},
                           in_axes=0, length=4)
        @N.compact
        def __call__(self, c, x):
            h = N.tanh(N.Dense(3)(c) + x)
            return h, h

    class DecoOuter(N.Module):
        @N.compact
        def __call__(self, c, xs):
            return Deco()(c, xs)

    class VmapFn(N.Module):
        @N.compact
        def __call__(self, xs):
            vm = N.vmap(lambda mdl, x: mdl(x), variable_axes={"params": 0},
                        split_rngs={"params": True}, in_axes=0)
            return vm(N.Dense(2), xs)
    return FnRNN, ClassRNN, DecoOuter, VmapFn


def _fn_inputs():
    r = np.random.default_rng(0)
    c = np.ones((2, 3), np.float32)
    return {"FnRNN": (c, r.standard_normal((2, 5, 4)).astype(np.float32)),
            "DecoOuter": (c, r.standard_normal((4, 2, 3)).astype(np.float32)),
            "VmapFn": (r.standard_normal((3, 2, 4)).astype(np.float32),)}


def test_function_form_equals_the_class_form():
    FnRNN, ClassRNN, _, _ = _fn_models(nn)
    args = _fn_inputs()["FnRNN"]
    v = FnRNN().init(random.PRNGKey(0), *args)
    vc = ClassRNN().init(random.PRNGKey(0), *args)
    assert [p for p, _ in _leaves_with_paths(v)] == [p for p, _ in _leaves_with_paths(vc)]
    for (p, a), (_, b) in zip(_leaves_with_paths(v), _leaves_with_paths(vc)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=p)
    (c1, y1), (c2, y2) = FnRNN().apply(v, *args), ClassRNN().apply(v, *args)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    assert y1.shape == (2, 5, 3)
    g1 = cts.grad(lambda p: cnp.sum(FnRNN().apply({"params": p}, *args)[1]))(v["params"])
    g2 = cts.grad(lambda p: cnp.sum(ClassRNN().apply({"params": p}, *args)[1]))(v["params"])
    for (p, a), (_, b) in zip(_leaves_with_paths(g1), _leaves_with_paths(g2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=p)


def test_function_and_decorator_forms_match_flax(jax_ref):
    names = ("FnRNN", "ClassRNN", "DecoOuter", "VmapFn")
    inputs = _fn_inputs()

    def flax_side(jax, fnn):
        theirs = dict(zip(names, _fn_models(fnn)))
        out = {}
        for name, args in inputs.items():
            fv = theirs[name]().init(jax.random.PRNGKey(0), *args)
            out[name] = {"v": _flax_leaves(jax, fv),
                         "out": _flax_leaves(jax, theirs[name]().apply(fv, *args))}
        return out

    want = jax_ref("flax", flax_side)
    ours = dict(zip(names, _fn_models(nn)))
    for name, args in inputs.items():
        v = ours[name]().init(random.PRNGKey(0), *args)
        _assert_trees_close(v, want[name]["v"])
        _assert_trees_close(ours[name]().apply(v, *args), want[name]["out"], rtol=1e-5,
                            atol=1e-6)


def test_function_form_errors():
    body = nn.scan(lambda m, c, x: m(c, x), variable_broadcast="params",
                   split_rngs={"params": False})
    with pytest.raises(TypeError, match="first argument must be a Module"):
        body(np.ones(3), np.ones(3), np.ones((2, 3)))
    with pytest.raises(RuntimeError, match="unbound"):
        body(nn.Dense(3), np.ones(3), np.ones((2, 3)))
    with pytest.raises(ValueError, match="methods= applies to a Module class"):
        nn.scan(lambda m, c, x: m(c, x), methods=["encode"])
    with pytest.raises(TypeError, match="Module class .* or a function"):
        nn.vmap(3)


# --- a lifted function that creates submodules ----------------------------------------------------

def _lifted_body_model(lib, case):
    class M(lib.Module):
        @lib.compact
        def __call__(self, x):
            if case == 'scan':
                c, _ = lib.scan(lambda _, c: (lib.Dense(2)(c), ()), variable_axes={'params': 0},
                                split_rngs={'params': 0}, length=3)(self, x)
                return c
            if case == 'scan_two':
                c, _ = lib.scan(lambda _, c: (lib.relu(lib.Dense(2)(lib.Dense(2)(c))), ()),
                                variable_axes={'params': 0}, split_rngs={'params': 0},
                                length=2)(self, x)
                return c
            return lib.vmap(lambda _, c: lib.Dense(3)(c), variable_axes={'params': 0},
                            split_rngs={'params': True}, in_axes=0)(self, x[None].repeat(4, 0))
    return M()


@pytest.mark.parametrize('case,want', [
    ('scan', {'Dense_0': {'bias': (3, 2), 'kernel': (3, 2, 2)}}),
    ('scan_two', {'Dense_0': {'bias': (2, 2), 'kernel': (2, 2, 2)},
                  'Dense_1': {'bias': (2, 2), 'kernel': (2, 2, 2)}}),
    ('vmap', {'Dense_0': {'bias': (4, 3), 'kernel': (4, 2, 3)}}),
])
def test_lifted_function_creating_submodules_gives_stacked_params(case, want, jax_ref):
    """nn.scan(lambda _, c: (nn.Dense(2)(c), ()), ...)(self, x) inside an @compact method (the
    README's promise): the body runs as a compact method of the caller, so its Dense is
    created there and its params are stacked (3, 2, 2). It raised 'Dense is unbound'."""
    x = np.ones((1, 2), np.float32)
    m = _lifted_body_model(nn, case)
    v = m.init(random.PRNGKey(0), x)
    assert cts.tree_util.tree_map(np.shape, v['params']) == want
    out = m.apply(v, x)
    def flax_side(jax, fnn):
        fm = _lifted_body_model(fnn, case)
        fv = fm.init(jax.random.PRNGKey(0), x)
        return {"params": jax.tree_util.tree_map(np.asarray, fv['params']), "out": fm.apply(fv, x)}

    theirs = jax_ref("flax", flax_side)
    assert cts.tree_util.tree_map(np.shape, theirs['params']) == want
    mine, flax_leaves = _leaves_with_paths(v['params']), _leaves_with_paths(theirs['params'])
    assert [p for p, _ in mine] == [p for p, _ in flax_leaves]
    for (p, a), (_, b) in zip(mine, flax_leaves):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6, atol=1e-7, err_msg=p)
    np.testing.assert_allclose(np.asarray(out), theirs['out'], rtol=1e-5, atol=1e-6)


def test_lifted_function_outside_a_compact_method_cannot_create_submodules():
    """As in Flax: only a caller running an @compact method lends its compact state."""
    class M(nn.Module):
        def setup(self):
            pass

        def __call__(self, x):
            c, _ = nn.scan(lambda _, c: (nn.Dense(2)(c), ()), variable_axes={'params': 0},
                           split_rngs={'params': 0}, length=3)(self, x)
            return c
    with pytest.raises(RuntimeError, match='submodules must be defined in `setup\\(\\)` or in a '
                                           'method wrapped in `@compact`'):
        M().init(random.PRNGKey(0), np.ones((1, 2), np.float32))
