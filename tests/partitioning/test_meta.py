"""Boxes: Partitioned / LogicallyPartitioned, unbox, replace_boxed, get_partition_spec,
get_sharding, logical_to_mesh(_sharding). Facts: flax_partitioning.md §2.7 and §3.5 (M*)."""
import os

os.environ.setdefault('CTRAINSTATE_NUM_CPU_DEVICES', '4')

import types  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import ctrainstate as cts  # noqa: E402
from ctrainstate import nn, tree_util  # noqa: E402
from ctrainstate.nn import meta  # noqa: E402
from ctrainstate.nn.scope import Scope  # noqa: E402
from ctrainstate.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


def _mesh(shape=(2, 2), names=('in', 'out')):
    if cts.device_count() < 4:
        pytest.skip('needs 4 CPU virtual devices')
    return cts.make_mesh(shape, names)


def test_names_exported():
    assert nn.PARTITION_NAME == 'partition_name'
    for name in ['logical_axis_rules', 'set_logical_axis_rules', 'get_logical_axis_rules',
                 'with_logical_constraint', 'Partitioned', 'LogicallyPartitioned',
                 'with_partitioning', 'with_logical_partitioning', 'get_partition_spec',
                 'get_sharding', 'unbox', 'replace_boxed']:
        assert hasattr(nn, name), name


def test_m4_unbox_tree():
    tree = {'kernel': nn.Partitioned(np.zeros((3, 2)), ('in', 'out')),
            'complex': nn.Partitioned({'K': np.zeros((3, 2)), 'b': np.zeros(3)}, ('data',))}
    shapes = tree_util.tree_map(lambda x: x.shape, nn.unbox(tree))
    assert shapes == {'kernel': (3, 2), 'complex': {'K': (3, 2), 'b': (3,)}}


def test_m6_get_partition_spec():
    tree = {'kernel': nn.Partitioned(np.zeros((8, 3, 3)), ('layers', 'in', 'out')),
            'bias': np.zeros((8, 3)), 'step': np.array(100)}
    assert nn.get_partition_spec(tree) == {'kernel': P('layers', 'in', 'out'), 'bias': P(), 'step': P()}


def test_get_partition_spec_shape_structs_and_others():
    sds = types.SimpleNamespace(shape=(4, 2), dtype=np.float32)   # a ShapeDtypeStruct stand-in
    spec = nn.get_partition_spec({'a': sds, 'n': 3, 's': 'text', 'l': nn.LogicallyPartitioned(
        np.zeros(2), ('embed',))})
    assert spec == {'a': P(), 'n': None, 's': None, 'l': P('embed')}


def test_m7_get_sharding():
    mesh = _mesh()
    tree = {'kernel': nn.Partitioned(np.zeros((8, 3)), ('in', 'out')), 'bias': np.zeros((8, 3)),
            'step': np.array(100), 'n': 3}
    got = nn.get_sharding(tree, mesh)
    assert got == {'kernel': NamedSharding(mesh, P('in', 'out')), 'bias': NamedSharding(mesh, P()),
                   'step': NamedSharding(mesh, P()), 'n': None}


def test_box_is_pytree_node_with_static_names():
    box = nn.Partitioned(np.ones(3), ('x',))
    leaves, td = tree_util.tree_flatten({'w': box})
    assert len(leaves) == 1 and leaves[0] is box.value
    rebuilt = tree_util.tree_unflatten(td, [np.zeros(3)])
    assert isinstance(rebuilt['w'], nn.Partitioned) and rebuilt['w'].names == ('x',)
    doubled = tree_util.tree_map(lambda v: v * 2, {'w': box})
    np.testing.assert_array_equal(doubled['w'].value, np.full(3, 2.0))
    lbox = nn.LogicallyPartitioned(np.ones(2), ('embed',), rules=(('embed', 'x'),))
    back = tree_util.tree_map(lambda v: v, lbox)
    assert isinstance(back, nn.LogicallyPartitioned) and back.rules == (('embed', 'x'),)


def test_boxes_are_frozen():
    box = nn.Partitioned(1, ('x',))
    with pytest.raises(AttributeError):
        box.names = ('y',)
    assert box.replace(names=('y',)).names == ('y',)


def test_add_remove_axis():
    box = nn.Partitioned(np.zeros((3, 2)), ('in', 'out'))
    assert box.add_axis(0, {nn.PARTITION_NAME: 'batch'}).names == ('batch', 'in', 'out')
    assert nn.Partitioned(0, ('a',)).add_axis(3, {nn.PARTITION_NAME: 'l'}).names == ('a', None, None, 'l')
    assert box.add_axis(0, {nn.PARTITION_NAME: 'b'}).remove_axis(0, {nn.PARTITION_NAME: 'b'}).names == ('in', 'out')
    with pytest.raises(meta.PartitioningUnspecifiedError, match='"partition_name" is not specified'):
        box.add_axis(0, {})   # M3
    with pytest.raises(ValueError):
        box.remove_axis(0, {nn.PARTITION_NAME: 'batch'})
    tree = meta.add_axis({'k': box, 'b': np.zeros(2)}, 0, {nn.PARTITION_NAME: 'layers'})
    assert tree['k'].names == ('layers', 'in', 'out')


def test_replace_boxed_keeps_boxes():
    tree = {'k': nn.Partitioned(np.zeros(2), ('a',)), 'b': np.zeros(2)}
    new = nn.replace_boxed(tree, {'k': np.ones(2), 'b': np.ones(2)})
    assert isinstance(new['k'], nn.Partitioned) and new['k'].names == ('a',)
    np.testing.assert_array_equal(new['k'].value, np.ones(2))
    np.testing.assert_array_equal(new['b'], np.ones(2))


def test_nested_box_unbox():
    assert nn.unbox({'k': nn.Partitioned(nn.Partitioned(3, ()), ('a',))}) == {'k': 3}


def test_with_partitioning_wrappers():
    def ones(key, shape):
        """ones init"""
        return np.ones(shape)

    init = nn.with_partitioning(ones, ('in', 'out'))
    assert init.__doc__ == 'ones init' and init.__name__ == 'ones'
    box = init(None, (3, 2))
    assert isinstance(box, nn.Partitioned) and box.names == ('in', 'out') and box.mesh is None
    rules = (('a', 'in'), ('b', 'out'))
    lbox = nn.with_logical_partitioning(ones, ('a', 'b'), rules=rules)(None, (3, 2))
    assert isinstance(lbox, nn.Partitioned) and isinstance(lbox, nn.LogicallyPartitioned)
    assert lbox.names == ('a', 'b') and lbox.rules is rules


def test_scope_stores_box_returns_value():
    s = Scope(rngs={'params': lambda: 0}, mutable=True)
    v = s.param('kernel', nn.with_partitioning(lambda k, shape: np.ones(shape), ('in', 'out')), (3, 2))
    assert isinstance(v, np.ndarray)
    assert isinstance(s.variables()['params']['kernel'], nn.Partitioned)
    var = s.variable('params', 'k2', nn.with_partitioning(lambda shape: np.ones(shape), ('in', 'out')), (3, 2))
    var.value = var.value + 1.0   # M2: the box survives a write
    stored = s.variables()['params']['k2']
    assert isinstance(stored, nn.Partitioned) and stored.names == ('in', 'out')
    assert float(var.value.sum()) == var.value.size * 2


def test_p12_logical_boxes_to_mesh_shardings():
    mesh = _mesh()
    rules = (('a', 'in'), ('b', 'out'))
    box = nn.with_logical_partitioning(lambda k, s: np.ones(s), ('a', 'b'), mesh=mesh, rules=rules)(None, (4, 2))
    spec = nn.get_partition_spec({'kernel': box})
    assert spec == {'kernel': P('a', 'b')}
    assert nn.logical_to_mesh_sharding(spec, mesh, rules) == {'kernel': NamedSharding(mesh, P('in', 'out'))}
    assert box.mesh is mesh and box.rules is rules


def test_partitioned_unbox_reshards_under_mesh():
    mesh = _mesh()
    host = np.arange(8, dtype=np.float32).reshape(4, 2)
    box = nn.Partitioned(cts.device_put(host, NamedSharding(mesh, P())), ('in', 'out'))
    assert box.unbox() is box.value                  # no mesh in reach: value as is
    with mesh:
        out = box.unbox()
    assert out.sharding == NamedSharding(mesh, P('in', 'out'))
    np.testing.assert_array_equal(np.asarray(out), host)
    assert box.unbox(apply_constraint=False) is box.value


def test_logically_partitioned_unbox_uses_rules_and_mesh():
    mesh = _mesh()
    host = np.arange(8, dtype=np.float32).reshape(4, 2)
    box = nn.LogicallyPartitioned(cts.device_put(host, NamedSharding(mesh, P())), ('a', 'b'),
                                  mesh=mesh, rules=(('a', 'out'),))
    out = box.unbox()
    assert out.sharding == NamedSharding(mesh, P('out', None))
    np.testing.assert_array_equal(np.asarray(out), host)
    no_rules = nn.LogicallyPartitioned(box.value, ('a', 'b'), mesh=mesh)
    assert no_rules.unbox() is box.value             # no rules: logical constraint is a no-op


def test_partitioned_box_under_jit_replicates_a_dimension_its_mesh_axis_does_not_divide():
    """jit(init) then jit(apply) of a with_partitioning kernel whose 'mp' axis (2) does not
    divide its 5 rows: born replicated there, and unbox's constraint keeps it so."""
    from ctrainstate import random

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.ones, ('mp', 'data'))
            return x @ self.param('k', init, (5, 4))

    mesh = cts.make_mesh((4, 2), ('data', 'mp'))
    x = np.ones((3, 5), np.float32)
    with mesh:
        v = cts.jit(M().init)(random.PRNGKey(0), x)
        assert v['params']['k'].value.sharding == NamedSharding(mesh, P(None, 'data'))
        y = cts.jit(M().apply)(v, x)
    np.testing.assert_array_equal(np.asarray(y), np.full((3, 4), 5.0, np.float32))
