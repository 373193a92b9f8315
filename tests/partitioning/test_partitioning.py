"""Logical constraints (W1-W11), param/variable metadata (P1-P8) through the minimal
scope, and real resharding of Arrays under a mesh.

Expected values: shared/reference/flax_partitioning.md §3.3 and §3.4.
"""
import os
import ctrainstate.numpy as cnp

os.environ.setdefault('CTRAINSTATE_NUM_CPU_DEVICES', '4')

from unittest import mock  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import ctrainstate as cts  # noqa: E402
from ctrainstate import nn  # noqa: E402
from ctrainstate import partitioning as nn_partitioning  # noqa: E402
from ctrainstate._src.nn import spmd  # noqa: E402
from ctrainstate.nn.scope import Scope, ScopeVariableNotFoundError  # noqa: E402
from ctrainstate.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

UNC = P.UNCONSTRAINED
R1 = (('foo', 'data'), ('bar', 'model'), ('baz', None))
AXIS_RULES_P = (('foo', 'model'), ('bar', 'data'), ('baz', None))
F = nn_partitioning.RulesFallback


@pytest.fixture(autouse=True)
def _clean_rules():
    nn_partitioning.set_axis_rules(())
    yield
    nn_partitioning.set_axis_rules(())


@pytest.fixture
def wsc():
    with mock.patch.object(spmd, '_with_sharding_constraint', side_effect=lambda x, *a, **k: x) as m:
        yield m


def _arr():
    return np.zeros((2, 2))


# --- W1-W11 ------------------------------------------------------------------------------

def test_w1_no_rules_no_call(wsc):
    arr = _arr()
    assert nn_partitioning.with_sharding_constraint(arr, ('foo', 'bar')) is arr
    wsc.assert_not_called()


def test_w2_none_spec_no_call(wsc):
    nn_partitioning.set_axis_rules(R1)
    arr = _arr()
    assert nn_partitioning.with_sharding_constraint(arr, None) is arr
    wsc.assert_not_called()


def test_w3_resolved_spec(wsc):
    nn_partitioning.set_axis_rules(R1)
    arr = _arr()
    nn_partitioning.with_sharding_constraint(arr, ('foo', 'bar'))
    wsc.assert_called_once_with(arr, P('data', 'model'), mesh=None)


def test_w4_unconstrained_kept(wsc):
    nn_partitioning.set_axis_rules(R1)
    arr = _arr()
    nn_partitioning.with_sharding_constraint(arr, ('foo', UNC))
    wsc.assert_called_once_with(arr, P('data', UNC), mesh=None)


@pytest.mark.parametrize('kw', [{}, {'fallback': F.AXIS_IS_UNSHARDED}], ids=['W5', 'W6'])
def test_w5_w6_unsharded_fallback(wsc, kw):
    nn_partitioning.set_axis_rules(R1)
    arr = _arr()
    nn_partitioning.with_sharding_constraint(arr, ('foo', 'not_recognized'), **kw)
    wsc.assert_called_once_with(arr, P('data', None), mesh=None)


def test_w7_raise_error(wsc):
    nn_partitioning.set_axis_rules(R1)
    with pytest.raises(ValueError) as e:
        nn_partitioning.with_sharding_constraint(_arr(), ('foo', 'not_recognized'),
                                                 fallback=F.RAISE_ERROR)
    assert str(e.value) == "Axis names ('foo', 'not_recognized') did not match a rule"
    wsc.assert_not_called()


def test_w8_no_constraint(wsc):
    nn_partitioning.set_axis_rules(R1)
    arr = _arr()
    out = nn_partitioning.with_sharding_constraint(arr, ('foo', 'not_recognized'),
                                                   fallback=F.NO_CONSTRAINT)
    assert out is arr
    wsc.assert_not_called()


def test_w9_duplicates_raise_without_mesh(wsc):
    nn_partitioning.set_axis_rules(R1)
    with pytest.raises(ValueError, match=r"Dimensions \('foo',\) occur more than once"):
        nn_partitioning.with_sharding_constraint(_arr(), ('foo', 'foo'))
    wsc.assert_not_called()


def test_w10_empty_rules_short_circuit(wsc):
    arr = _arr()
    out = nn_partitioning.with_sharding_constraint(arr, ('foo', 'foo'), fallback=F.RAISE_ERROR)
    assert out is arr
    wsc.assert_not_called()


def test_w11_real_helper_without_mesh_is_identity():
    nn_partitioning.set_axis_rules(R1)
    arr = _arr()
    assert nn_partitioning.with_sharding_constraint(arr, ('foo', 'bar')) is arr
    a = cts.device_put(np.ones((4, 4), np.float32))
    assert nn_partitioning.with_sharding_constraint(a, ('foo', 'bar')) is a


def test_rules_and_mesh_arguments_passed_through(wsc):
    arr = _arr()
    sentinel_mesh = object()
    nn.with_logical_constraint(arr, ('foo', 'bar'), rules=R1, mesh=sentinel_mesh)
    wsc.assert_called_once_with(arr, P('data', 'model'), mesh=sentinel_mesh)


def test_spec_tree_is_prefix_of_value_tree(wsc):
    x = {'a': _arr(), 'b': (_arr(), _arr())}
    nn.with_logical_constraint(x, {'a': ('foo',), 'b': ('bar', None)}, rules=R1)
    calls = {id(c.args[0]): c.args[1] for c in wsc.call_args_list}
    assert calls[id(x['a'])] == P('data')
    assert calls[id(x['b'])] == P('model', None)   # a leaf spec covers a whole sub-tree
    assert wsc.call_count == 2


def test_none_leaf_inside_tree_calls_helper_with_none(wsc):
    x = {'a': _arr(), 'b': _arr()}
    nn.with_logical_constraint(x, {'a': None, 'b': ('foo',)}, rules=R1)
    calls = {id(c.args[0]): c.args[1] for c in wsc.call_args_list}
    assert calls[id(x['a'])] is None and calls[id(x['b'])] == P('data')


# --- real constraint with a mesh -----------------------------------------------------------

def _mesh():
    if cts.device_count() < 4:
        pytest.skip('needs 4 CPU virtual devices (CTRAINSTATE_NUM_CPU_DEVICES=4)')
    return cts.make_mesh((2, 2), ('data', 'model'))


def test_constraint_reshards_array_under_mesh():
    mesh = _mesh()
    host = np.arange(16, dtype=np.float32).reshape(4, 4)
    x = cts.device_put(host, NamedSharding(mesh, P()))
    with mesh, nn_partitioning.axis_rules(R1):
        y = nn_partitioning.with_sharding_constraint(x, ('foo', 'bar'))
    assert y.sharding == NamedSharding(mesh, P('data', 'model'))
    np.testing.assert_array_equal(np.asarray(y), host)
    assert y.addressable_shards[0].data.shape == (2, 2)


def test_constraint_with_mesh_argument_and_no_context():
    mesh = _mesh()
    host = np.arange(8, dtype=np.float32).reshape(4, 2)
    x = cts.device_put(host, NamedSharding(mesh, P()))
    y = nn.with_logical_constraint(x, ('bar', 'baz'), rules=R1, mesh=mesh)
    assert y.sharding == NamedSharding(mesh, P('model', None))
    np.testing.assert_array_equal(np.asarray(y), host)


def test_constraint_already_satisfied_returns_same_array():
    mesh = _mesh()
    x = cts.device_put(np.ones((4, 4), np.float32), NamedSharding(mesh, P('data', 'model')))
    assert nn.with_logical_constraint(x, ('foo', 'bar'), rules=R1, mesh=mesh) is x


def test_numpy_under_mesh_is_noop():
    mesh = _mesh()
    arr = _arr()
    with mesh:
        assert nn.with_logical_constraint(arr, ('foo', 'bar'), rules=R1) is arr


def test_constraint_on_subtree_reshards_every_array():
    mesh = _mesh()
    x = {'a': cts.device_put(np.ones((4, 4), np.float32), NamedSharding(mesh, P())),
         'b': (cts.device_put(np.ones((4, 2), np.float32), NamedSharding(mesh, P())), np.ones(3))}
    y = nn.with_logical_constraint(x, {'a': ('foo', 'bar'), 'b': ('foo',)}, rules=R1, mesh=mesh)
    assert y['a'].sharding == NamedSharding(mesh, P('data', 'model'))
    assert y['b'][0].sharding == NamedSharding(mesh, P('data'))
    assert y['b'][1] is x['b'][1]


def test_unconstrained_keeps_current_split():
    mesh = _mesh()
    host = np.arange(16, dtype=np.float32).reshape(4, 4)
    x = cts.device_put(host, NamedSharding(mesh, P(None, 'model')))
    y = nn.with_logical_constraint(x, ('foo', UNC), rules=R1, mesh=mesh)
    assert y.sharding == NamedSharding(mesh, P('data', 'model'))
    np.testing.assert_array_equal(np.asarray(y), host)


# --- P1-P8: param_with_axes / variable_with_axes / get_axis_names --------------------------

def _zeros_init(key, shape, dtype=np.float32):
    return np.zeros(shape, dtype)


def _scope(mutable=True, variables=None):
    return Scope(variables=variables, rngs={'params': lambda: 0}, mutable=mutable)


def test_p1_axes_none():
    s = _scope()
    with s:
        v = nn_partitioning.param_with_axes('foo', _zeros_init, (2, 2), np.float32, axes=None)
    assert v.shape == (2, 2)
    assert set(s.variables()) == {'params'}


def test_p2_axes_empty_tuple_on_scalar_and_rank_error():
    s = _scope()
    with s:
        nn_partitioning.param_with_axes('s', lambda k: np.float32(1.0), axes=())
    assert s.variables()['params_axes'] == {'s_axes': nn_partitioning.AxisMetadata(names=())}
    assert nn_partitioning.get_axis_names(s.variables()['params_axes']) == {'s': P()}


def test_p3_param_axes_recorded():
    s = _scope()
    with nn_partitioning.axis_rules(AXIS_RULES_P), s:
        nn_partitioning.param_with_axes('foo', _zeros_init, (2, 2), np.float32, axes=('foo', 'bar'))
    variables = s.variables()
    assert set(variables) == {'params', 'params_axes'}
    assert variables['params_axes']['foo_axes'] == nn_partitioning.AxisMetadata(names=('foo', 'bar'))
    assert nn_partitioning.get_axis_names(variables['params_axes']) == {'foo': P('foo', 'bar')}


def test_p4_pytree_axes():
    axes = {'a': ('foo', 'bar'), 'b': (('foo', 'bar'), ('bar', 'foo'))}
    z = np.zeros((2, 2))
    s = _scope()
    with nn_partitioning.axis_rules(AXIS_RULES_P), s:
        nn_partitioning.param_with_axes('foo', lambda k: {'a': z, 'b': (z, z)}, axes=axes)
    pa = s.variables()['params_axes']
    assert pa['foo_axes'] == nn_partitioning.AxisMetadata(names=axes)
    assert nn_partitioning.get_axis_names(pa) == {
        'foo': {'a': P('foo', 'bar'), 'b': (P('foo', 'bar'), P('bar', 'foo'))}}


def test_p5_variable_axes_none():
    s = _scope()
    with s:
        v = nn_partitioning.variable_with_axes('test', 'foo', np.zeros, (2, 2), np.float32, axes=None)
    assert v.value.shape == (2, 2)
    assert set(s.variables()) == {'test'}


def test_p6_variable_axes_empty():
    s = _scope()
    with s:
        nn_partitioning.variable_with_axes('test', 'foo', lambda: np.float32(0), axes=())
    assert nn_partitioning.get_axis_names(s.variables()['test_axes']) == {'foo': P()}


def test_p7_variable_axes_recorded():
    s = _scope()
    with nn_partitioning.axis_rules(AXIS_RULES_P), s:
        nn_partitioning.variable_with_axes('test', 'foo', np.zeros, (2, 2), np.float32,
                                           axes=('foo', 'bar'))
    variables = s.variables()
    assert set(variables) == {'test', 'test_axes'}
    assert variables['test_axes']['foo_axes'] == nn_partitioning.AxisMetadata(names=('foo', 'bar'))
    assert nn_partitioning.get_axis_names(variables['test_axes']) == {'foo': P('foo', 'bar')}


def test_p8_no_constraint_fallback(wsc):
    s = _scope()
    with nn_partitioning.axis_rules((('bar', 'data'), ('baz', None))), s:
        v = nn_partitioning.variable_with_axes('test', 'foo', np.zeros, (2, 2), np.float32,
                                               axes=('foo', 'bar'), fallback=F.NO_CONSTRAINT)
        _ = v.value
    wsc.assert_not_called()
    assert s.variables()['test_axes']['foo_axes'] == nn_partitioning.AxisMetadata(('foo', 'bar'))


def test_param_with_axes_applies_constraint(wsc):
    s = _scope()
    with nn_partitioning.axis_rules(AXIS_RULES_P), s:
        nn_partitioning.param_with_axes('w', _zeros_init, (2, 2), axes=('foo', 'bar'))
    assert wsc.call_count == 1
    assert wsc.call_args.args[1] == P('model', 'data')


def test_rank_mismatch_names_path_shape_and_axes():
    s = _scope().push('encoder')
    with pytest.raises(ValueError) as e:
        nn_partitioning.param_with_axes('kernel', _zeros_init, (2, 3, 4), axes=('embed', 'mlp'),
                                        module=s)
    msg = str(e.value)
    assert 'encoder/kernel' in msg and '(2, 3, 4)' in msg and "('embed', 'mlp')" in msg
    with pytest.raises(ValueError, match='cache/k'):
        nn_partitioning.variable_with_axes('cache', 'k', np.zeros, (2,), axes=('a', 'b'),
                                           module=Scope(mutable=True, path=('cache',)))


def test_apply_with_immutable_axes_skips_sow_and_reuses_params():
    s = _scope()
    with s:
        w = nn_partitioning.param_with_axes('w', _zeros_init, (2, 2), axes=('foo', 'bar'))
    params = {'params': s.variables()['params']}
    s2 = _scope(mutable=False, variables=params)
    with s2:
        w2 = nn_partitioning.param_with_axes('w', _zeros_init, (2, 2), axes=('foo', 'bar'))
    assert w2 is w
    assert 'params_axes' not in s2.variables()


def test_sow_twice_must_match():
    s = _scope()
    nn_partitioning.param_with_axes('w', _zeros_init, (2, 2), axes=('a', 'b'), module=s)
    s.sow('params_axes', 'w_axes', nn_partitioning.AxisMetadata(('a', 'b')),
          reduce_fn=nn_partitioning._param_with_axes_sow_reduce_fn)
    with pytest.raises(ValueError, match='If axis names are sown twice, expected them to match'):
        s.sow('params_axes', 'w_axes', nn_partitioning.AxisMetadata(('a', 'c')),
              reduce_fn=nn_partitioning._param_with_axes_sow_reduce_fn)
    with pytest.raises(TypeError, match='Expected newly sown value to be an AxisMetadata'):
        s.sow('params_axes', 'w_axes', ('a', 'b'),
              reduce_fn=nn_partitioning._param_with_axes_sow_reduce_fn)


def test_variable_missing_in_immutable_collection():
    s = Scope(variables={}, mutable=False, path=('blk',))
    with pytest.raises(ScopeVariableNotFoundError, match='No Variable named "foo" for collection "test"'):
        nn_partitioning.variable_with_axes('test', 'foo', np.zeros, (2,), axes=('a',), module=s)


def test_no_scope_is_a_clear_error():
    with pytest.raises(ValueError, match='need a module or scope'):
        nn_partitioning.param_with_axes('w', _zeros_init, (2,), axes=('a',))


def test_partitioned_variable_write_applies_constraint(wsc):
    s = _scope()
    with nn_partitioning.axis_rules(R1), s:
        v = nn_partitioning.variable_with_axes('stats', 'm', np.zeros, (2, 2), axes=('foo', 'bar'))
        wsc.reset_mock()
        v.value = np.ones((2, 2))
        wsc.assert_called_once()
        assert wsc.call_args.args[1] == P('data', 'model')
    np.testing.assert_array_equal(s.variables()['stats']['m'], np.ones((2, 2)))


def test_get_axis_names_quirks():
    md = nn_partitioning.AxisMetadata
    got = nn_partitioning.get_axis_names({
        'enc': {'layer_axes': {'kernel_axes': md(('a', None))}, 'empty': {}},
        'x_axes_axes': md(None),
    })
    assert got == {'enc': {'layer_axes': {'kernel': P('a', None)}}, 'x_axes': None}


def test_param_with_axes_under_mesh_creates_sharded_param():
    mesh = _mesh()

    def init(key, shape):
        return cts.device_put(np.arange(np.prod(shape), dtype=np.float32).reshape(shape))

    s = _scope()
    with mesh, nn_partitioning.axis_rules((('embed', 'data'), ('mlp', 'model'))), s:
        w = nn_partitioning.param_with_axes('wi', init, (4, 8), axes=('embed', 'mlp'))
    assert w.sharding == NamedSharding(mesh, P('data', 'model'))
    np.testing.assert_array_equal(np.asarray(w), np.arange(32, dtype=np.float32).reshape(4, 8))


def test_placement_errors_are_not_reported_as_tree_mismatches():
    """A leaf that cannot take its sharding (a size the mesh axis does not divide) says so;
    only a tree that does not match is reported as a mismatch."""
    import ctrainstate.numpy as cnp
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    with mesh:
        with pytest.raises(ValueError, match=r"^with_sharding_constraint: dimension 0 of size 9 "
                                             r"is not divisible by mesh axis 'data'"):
            cts.lax.with_sharding_constraint(cnp.ones(9), cts.P("data"))
        with pytest.raises(ValueError, match="shardings tree is not a prefix of the values"):
            cts.lax.with_sharding_constraint({"a": cnp.ones(8)}, {"b": cts.P("data")})
        with pytest.raises(ValueError, match=r"^jit in_shardings: dimension 0 of size 9 is not "
                                             r"divisible"):
            cts.jit(lambda x: x, in_shardings=cts.P("data"))(cnp.ones(9))
        with pytest.raises(ValueError, match="sharding tree does not match the values"):
            cts.jit(lambda x: x, in_shardings=({"b": cts.P()},))({"a": cnp.ones(8)})


def test_unconstrained_dimension_gives_up_the_axes_constrained_dimensions_take():
    """with_logical_constraint with UNCONSTRAINED keeps a dimension's current split less
    the mesh axes the constrained dimensions use (jax on CPU: P('model', None) constrained to
    (UNCONSTRAINED, 'model') gives P(None, 'model')); it raised about P('model', 'model')."""
    from ctrainstate import partitioning as nnp
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    U = cts.P.UNCONSTRAINED
    rules = (("Ldata", "data"), ("Lmodel", "model"))
    cases = [(cts.P("model", None), (U, "Lmodel"), cts.P(None, "model")),
             (cts.P(("data", "model")), (U, "Ldata"), cts.P("model", "data")),
             (cts.P(None, "data"), ("Ldata", U), cts.P("data", None)),
             (cts.P("model", "data"), (U, U), cts.P("model", "data"))]
    for src, logical, want in cases:
        a = cts.device_put(x, cts.NamedSharding(mesh, src))
        with mesh:
            b = nnp.with_sharding_constraint(a, logical, rules=rules)
        assert b.sharding.spec == want, (src, logical, b.sharding.spec)
        np.testing.assert_array_equal(np.asarray(b), x)


def test_eval_shape_runs_a_model_that_calls_astype():
    """Inside eval_shape the values are ShapeDtypeStructs: x.astype(...) in a model's
    __call__ raised AttributeError, breaking eval_shape(model.init, ...)."""
    import ctrainstate.numpy as cnp
    from ctrainstate import nn

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(x.astype(cnp.float32)).astype(cnp.bfloat16)
    shapes = cts.eval_shape(M().init, cts.random.PRNGKey(0), np.ones((2, 3), np.float32))
    assert shapes["params"]["Dense_0"]["kernel"].shape == (3, 4)
    out = cts.eval_shape(lambda t: t.astype(cnp.bfloat16), np.ones(3, np.float32))
    assert out.shape == (3,) and out.dtype == cnp.bfloat16


# --- axes=() means replicated ----------------------------------------------------------------

def test_param_with_axes_empty_axes_on_a_matrix_means_replicated():
    """Flax stores names=() for a non-scalar param (no rank check for an empty tuple); the
    rank check stays for every non-empty tuple."""
    s = _scope()
    with nn_partitioning.axis_rules(AXIS_RULES_P), s:
        w = nn_partitioning.param_with_axes('w', _zeros_init, (2, 3), axes=())
    assert w.shape == (2, 3)
    assert s.variables()['params_axes'] == {'w_axes': nn_partitioning.AxisMetadata(names=())}
    assert nn_partitioning.get_axis_names(s.variables()['params_axes']) == {'w': P()}
    with pytest.raises(ValueError, match='do not match its rank'):
        nn_partitioning.param_with_axes('v', _zeros_init, (2, 3), axes=('foo',), module=_scope())
    v = _scope()
    with v:
        nn_partitioning.variable_with_axes('cache', 'k', np.zeros, (2, 4), axes=())
    assert nn_partitioning.get_axis_names(v.variables()['cache_axes']) == {'k': P()}


def test_param_with_axes_empty_axes_under_a_mesh_is_born_replicated():
    mesh = cts.make_mesh((2, 4), ('data', 'model'))
    s = _scope()
    with mesh, nn_partitioning.axis_rules(AXIS_RULES_P), s:
        w = nn_partitioning.param_with_axes('w', nn.initializers.ones, (4, 8), axes=())
    assert w.sharding == NamedSharding(mesh, P())
    np.testing.assert_array_equal(np.asarray(w), np.ones((4, 8), np.float32))


def test_param_with_axes_rank_mismatch_under_a_mesh_names_the_param():
    """Under a mesh the rank is checked before the sharded value is laid out, so the error
    names the parameter (not the layout's 'entries but the array has rank')."""
    mesh = cts.make_mesh((2, 4), ('data', 'model'))
    with mesh, nn_partitioning.axis_rules(AXIS_RULES_P):
        for init in (nn.initializers.zeros, _zeros_init):  # in place / on the host, scattered
            s = _scope().push('enc')
            with pytest.raises(ValueError, match=r'"enc/w" do not match its rank: shape '
                                                 r'\(2, 3\)'):
                nn_partitioning.param_with_axes('w', init, (2, 3), axes=('foo', 'bar', 'baz'),
                                                module=s)
            assert not s.has_variable('params', 'w')
        w = nn_partitioning.param_with_axes('w', nn.initializers.zeros, (2, 4),
                                            axes=('bar', 'foo'), module=_scope())
    assert w.sharding == NamedSharding(mesh, P('data', 'model'))


# --- under jit a non-dividing mesh axis replicates its dimension -----------------------------

def test_logical_constraint_under_jit_replicates_a_dimension_the_axis_does_not_divide():
    from ctrainstate._src.base.trace_state import jit_scope
    mesh = cts.make_mesh((4, 2), ('data', 'model'))
    x = cts.device_put(np.arange(28, dtype=np.float32).reshape(7, 4))
    rules = (('vocab', 'model'), ('embed', 'data'))
    with mesh, nn_partitioning.axis_rules(rules):
        with jit_scope():
            y = nn_partitioning.with_sharding_constraint(x, ('vocab', 'embed'))
        assert y.sharding == NamedSharding(mesh, P(None, 'data'))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
        with pytest.raises(ValueError, match="size 7 is not divisible by mesh axis 'model'"):
            nn_partitioning.with_sharding_constraint(x, ('vocab', 'embed'))   # eager


def test_param_with_axes_under_jit_is_born_replicated_on_a_non_dividing_axis():
    from ctrainstate._src.base.trace_state import jit_scope
    mesh = cts.make_mesh((4, 2), ('data', 'mp'))
    rules = (('vocab', 'mp'), ('embed', 'data'))
    for init in (nn.initializers.ones, lambda k, shape: np.ones(shape, np.float32)):
        s = _scope()
        with mesh, nn_partitioning.axis_rules(rules), s, jit_scope():
            w = nn_partitioning.param_with_axes('wte', init, (50257, 16), axes=('vocab', 'embed'))
        assert w.shape == (50257, 16)
        assert w.sharding == NamedSharding(mesh, P(None, 'data'))
    s = _scope()
    with mesh, nn_partitioning.axis_rules(rules), s:
        with pytest.raises(ValueError, match=r"^parameter \"wte\" of shape \(50257, 16\): "
                                             r"dimension 0 \(logical axis 'vocab'\) of size "
                                             r"50257 is not divisible by mesh axes \('mp',\)"):
            nn_partitioning.param_with_axes("wte", nn.initializers.ones, (50257, 16),
                                            axes=('vocab', 'embed'))


def test_get_axis_names_returns_a_frozendict_as_flax():
    from ctrainstate.core import FrozenDict
    md = nn_partitioning.AxisMetadata
    got = nn_partitioning.get_axis_names({'enc': {'kernel_axes': md(('a', None))},
                                          'b_axes': md(())})
    assert type(got) is FrozenDict and type(got['enc']) is FrozenDict
    assert got == {'enc': {'kernel': P('a', None)}, 'b': P()}
    assert type(nn_partitioning.get_axis_names({})) is FrozenDict


# --- strict rules name the parameter --------------------------------------------------------------

def test_strict_axis_rules_name_the_parameter_and_the_logical_name():
    rules = (('batch', 'data'), ('embed', None), ('mlp', 'model'))

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(8, name='fc', kernel_init=nn.with_logical_partitioning(
                nn.initializers.ones, ('embed', 'mpl')))(x)
            return h + nn_partitioning.param_with_axes('w', nn.initializers.zeros, (8,),
                                                       axes=('mlp',))

    class P2(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn_partitioning.param_with_axes('w', nn.initializers.zeros, (4, 8),
                                                   axes=('embd', 'mlp'))

    x = np.ones((2, 4), np.float32)
    key = cts.random.PRNGKey(0)
    mesh = cts.make_mesh((2, 4), ('data', 'model'))
    for ctx in (lambda: nn_partitioning.axis_rules(rules, strict=True),
                lambda: _both(mesh, nn_partitioning.axis_rules(rules, strict=True))):
        with ctx():
            with pytest.raises(ValueError, match=r"^parameter 'fc/kernel': logical axis name "
                                                 r"'mpl' of \('embed', 'mpl'\) matches no rule"):
                M().init(key, x)
            with pytest.raises(ValueError, match=r"^parameter 'w': logical axis name 'embd'"):
                P2().init(key, x)
        with pytest.raises(ValueError, match=r"^variable 'cache/k': logical axis name 'bach'"):
            with nn_partitioning.axis_rules(rules, strict=True):
                nn_partitioning.variable_with_axes('cache', 'k', np.zeros, (2, 4),
                                                   axes=('bach', 'embed'), module=_scope())
    with nn_partitioning.axis_rules(rules):   # default: Flax's silent replication
        assert M().init(key, x)['params']['fc']['kernel'].names == ('embed', 'mpl')


def _both(a, b):
    import contextlib
    stack = contextlib.ExitStack()
    stack.enter_context(a)
    stack.enter_context(b)
    return stack


def test_eval_shape_of_init_replicates_a_dimension_the_axis_does_not_divide_as_jit_does():
    # jax.eval_shape traces like jit: a 50257-token vocabulary over mp=2 gets a spec, no error
    mesh = cts.make_mesh((4, 2), ('data', 'mp'))
    rules = (('vocab', 'mp'), ('embed', 'data'))

    def init():
        return nn_partitioning.param_with_axes('wte', nn.initializers.ones, (50257, 16),
                                               axes=('vocab', 'embed'))
    with mesh, nn_partitioning.axis_rules(rules):
        s = _scope()
        with s:
            out = cts.eval_shape(init)
    assert out.shape == (50257, 16) and out.sharding == NamedSharding(mesh, P(None, 'data'))


def test_lax_with_sharding_constraint_under_jit_replicates_a_dimension_the_axis_does_not_divide():
    from ctrainstate import lax
    mesh = cts.make_mesh((4, 2), ('data', 'model'))
    x = cts.device_put(np.arange(28, dtype=np.float32).reshape(7, 4))
    with mesh:
        y = cts.jit(lambda a: lax.with_sharding_constraint(a, P('model', 'data')))(x)
        assert y.sharding == NamedSharding(mesh, P(None, 'data'))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
        with pytest.raises(ValueError, match="not divisible"):
            lax.with_sharding_constraint(x, P('model', 'data'))      # eager: an error


# --- snippets a user ports from Flax / optax / JAX by changing imports: each checked against the
# value Flax/optax/JAX define, live when installed (those parts skip cleanly otherwise) and derived
# by hand

def _jax():
    return pytest.importorskip("jax")


def test_lax_with_sharding_constraint():
    from ctrainstate import lax
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    s = cts.NamedSharding(mesh, cts.P("data", "model"))
    a = np.arange(32, dtype=np.float32).reshape(8, 4)
    x = cts.device_put(a)
    y = lax.with_sharding_constraint(x, s)
    assert y.sharding == s and y.addressable_shards[5].index == (slice(4, 8), slice(1, 2))
    np.testing.assert_array_equal(np.asarray(y), a)
    with mesh:                                             # a PartitionSpec uses the active mesh
        t = cts.with_sharding_constraint({"a": x, "b": [x]}, {"a": cts.P("model"), "b": cts.P()})
    assert t["a"].sharding == cts.NamedSharding(mesh, cts.P("model"))
    assert t["b"][0].sharding == cts.NamedSharding(mesh, cts.P())
    with pytest.raises(ValueError, match="with mesh"):
        lax.with_sharding_constraint(x, cts.P("data"))
    ids = lax.with_sharding_constraint({"ids": np.arange(8, dtype=np.int32), "n": 3},
                                       {"ids": cts.NamedSharding(mesh, cts.P("data")),
                                        "n": cts.NamedSharding(mesh, cts.P())})
    assert ids["ids"].dtype == np.int32 and ids["ids"].sharding.spec == cts.P("data")
    assert ids["ids"].tolist() == list(range(8)) and int(ids["n"]) == 3
    # differentiable: the gradient comes back with the input's sharding
    g = cts.grad(lambda v: cnp.sum(cnp.square(lax.with_sharding_constraint(v, s))))(x)
    assert g.sharding == x.sharding
    np.testing.assert_allclose(np.asarray(g), 2 * a)


def test_with_sharding_constraint_device_and_single_device_sharding():
    from ctrainstate import lax
    from ctrainstate.sharding import SingleDeviceSharding
    mesh = cts.make_mesh((8,), ("x",))
    a = np.arange(8, dtype=np.float32)
    x = cts.device_put(a, cts.NamedSharding(mesh, cts.P("x")))
    # a SingleDeviceSharding places on that device (as in JAX); differentiable
    s3 = SingleDeviceSharding(cts.devices()[3])
    y = lax.with_sharding_constraint(x, s3)
    assert y.sharding == s3 and [sh.device.id for sh in y.addressable_shards] == [3]
    np.testing.assert_array_equal(np.asarray(y), a)
    g = cts.grad(lambda v: cnp.sum(cnp.square(lax.with_sharding_constraint(v, s3))))(x)
    assert g.sharding == x.sharding and np.asarray(g).tolist() == (2 * a).tolist()
    # a bare Device (or a string) is a TypeError naming it, as in JAX; not "outside a mesh"
    with mesh:
        with pytest.raises(TypeError, match=r"got Device CpuDevice.*SingleDeviceSharding\("):
            lax.with_sharding_constraint(x, cts.devices()[3])
    with pytest.raises(TypeError, match="got Device CpuDevice"):
        lax.with_sharding_constraint(x, cts.devices()[3])
    with pytest.raises(TypeError, match="got str"):
        lax.with_sharding_constraint(x, "x")


def test_with_sharding_constraint_device_matches_jax():
    jax = _jax()
    from jax.sharding import SingleDeviceSharding as JSDS
    y = jax.lax.with_sharding_constraint(jax.numpy.ones(8), JSDS(jax.devices()[3]))
    assert [d.id for d in y.devices()] == [3]
    with pytest.raises(TypeError):
        jax.lax.with_sharding_constraint(jax.numpy.ones(8), jax.devices()[3])
