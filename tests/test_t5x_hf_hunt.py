"""Regression tests for parity bugs found in ``ctrainstate.t5x`` and ``ctrainstate.hf``.

Expectations come from shared/reference/t5x_hf.md (section cited per test), from the
upstream code the reference describes, from live flax where it applies, or by hand.
"""
import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import P, hf, optim
from ctrainstate._src.base import dtypes as _dtypes
from ctrainstate.t5x import adafactor, optimizers

BF16 = _dtypes.bfloat16


# --- t5x.optimizers.OptaxStatePartitionRules --------------------------------------------------

def test_optax_state_partition_rules_two_argument_form():
    """t5x_hf.md §1.3: ``OptaxStatePartitionRules.derive_optax_logical_axes(state, params_axes)``
    (t5x's signature: no params). mu/nu get the param axes, counters None, EmptyState stays,
    MaskedNode entries are kept (t5x's derive_params_axes). It raised a tree-structure
    ValueError (it flattened ``params=None``)."""
    R = optimizers.OptaxStatePartitionRules
    params = {'w': np.zeros((4, 2), np.float32), 'b': np.zeros(2, np.float32)}
    axes = {'w': P('embed', 'mlp'), 'b': None}
    got = R.derive_optax_logical_axes(optim.adam(1e-3).init(params), axes)
    adam = got[0]
    assert adam.count is None
    assert adam.mu == axes and adam.nu == axes
    assert type(got[1]).__name__ == 'EmptyState'

    st = optim.masked(optim.adam(1e-3), {'w': True, 'b': False}).init(params)
    got = R.derive_optax_logical_axes(st, axes)
    inner = got.inner_state[0]
    assert inner.count is None
    assert inner.mu['w'] == P('embed', 'mlp') and type(inner.mu['b']).__name__ == 'MaskedNode'
    # t5x's derive_params_axes: the axes, with the MaskedNode holes of the optax params
    d = R.derive_params_axes(st.inner_state[0].mu, axes)
    assert d['w'] == P('embed', 'mlp') and type(d['b']).__name__ == 'MaskedNode'


# --- t5x.adafactor: state dtypes ----------------------------------------------------------------

def test_adafactor_state_dtypes_with_bfloat16_params_and_momentum():
    """t5x adafactor ``init_param_state``: v_row/v_col/v are float32 zeros and m is
    ``zeros(param.shape, dtype_momentum)``, whatever the param dtype. With bfloat16 params
    ctrainstate gave v and m as abstract ShapeDtypeStructs and the first step crashed; m
    was float32 whatever ``dtype_momentum`` said."""
    p = {'w': cts.device_put(np.ones((4, 2), np.float32)).astype(BF16)}
    opt = adafactor.Adafactor(0.1, beta1=0.9, dtype_momentum=BF16).create(p)
    st = opt.state.param_states['w']
    assert isinstance(st.v, cts.Array) and st.v.dtype == np.float32 and st.v.shape == (4, 2)
    assert isinstance(st.m, cts.Array) and st.m.dtype == BF16 and st.m.shape == (4, 2)
    assert st.v_row.dtype == np.float32 and st.v_row.shape == (1,)

    opt = opt.apply_gradient({'w': np.ones((4, 2), np.float32)})
    st = opt.state.param_states['w']
    # by hand, step 0 (unfactored, min_dim_size_to_factor 128): decay 0, v = g^2 + 1e-30,
    # y = 1, no clipping, parameter scale rms(1) = 1, update 0.1 * 1; m = 0.1 * 0.1; p = 1 - m
    assert st.m.dtype == BF16 and st.v.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(st.v), np.float32(1.0))
    np.testing.assert_array_equal(np.asarray(st.m).astype(np.float32),
                                  np.float32(0.01).astype(BF16).astype(np.float32))
    w = opt.target['w']
    assert w.dtype == BF16
    np.testing.assert_array_equal(np.asarray(w).astype(np.float32),
                                  np.float32(0.99).astype(BF16).astype(np.float32))


# --- hf.cast: masks and dtypes -----------------------------------------------------------------

def _params():
    return {'b': {'scale': cts.device_put(np.ones(2, np.float32)),
                  'k': cts.device_put(np.ones(2, np.float16))},
            'a': cts.device_put(np.ones(3, np.float32)),
            'i': cts.device_put(np.arange(2, dtype=np.int32))}


def test_to_bf16_takes_a_mask():
    """HF ``FlaxPreTrainedModel.to_bf16(params, mask=None)`` (``_cast_floating_to``): the mask
    is a tree like the params with boolean leaves, True = cast; every floating leaf is cast
    (float16 too), integers never. ctrainstate's to_bf16 had no ``mask`` (TypeError) and left
    float16 leaves alone."""
    mask = {'a': True, 'b': {'k': True, 'scale': False}, 'i': True}
    r = hf.to_bf16(_params(), mask)
    assert r['a'].dtype == BF16 and r['b']['k'].dtype == BF16
    assert r['b']['scale'].dtype == np.float32 and r['i'].dtype == np.int32
    r = hf.to_fp16(_params(), mask)
    assert r['a'].dtype == np.float16 and r['b']['scale'].dtype == np.float32
    r = hf.to_fp32(hf.to_bf16(_params()), {'a': False, 'b': {'k': True, 'scale': True},
                                          'i': False})
    assert r['a'].dtype == BF16 and r['b']['k'].dtype == np.float32
    assert r['b']['scale'].dtype == np.float32
    # no mask: every float leaf
    r = hf.to_bf16(_params())
    assert r['b']['k'].dtype == BF16 and r['a'].dtype == BF16 and r['i'].dtype == np.int32


def test_cast_mask_of_another_structure_is_an_error():
    """HF zips the flattened mask with the params and silently casts the wrong leaves when
    they differ; ctrainstate raises (DESIGN.md: a clear error for a user error)."""
    with pytest.raises(ValueError, match='mask does not have the structure of params'):
        hf.to_bf16(_params(), {'a': True})


# --- t5x.optimizers.MultiOptimizer ----------------------------------------------------------------

def _two_part(dec_rules=None):
    """Variables with an 'enc' and a 'dec' kernel of different logical axes, and a
    MultiOptimizer of two Adafactors, one per part (the second with ``dec_rules``)."""
    from ctrainstate.partitioning import AxisMetadata
    F = adafactor.FactorDim
    variables = {
        'params': {'enc': {'kernel': np.ones((4, 8), np.float32)},
                   'dec': {'kernel': np.ones((8, 4), np.float32)}},
        'params_axes': {'enc': {'kernel_axes': AxisMetadata(('embed', 'mlp'))},
                        'dec': {'kernel_axes': AxisMetadata(('foo', 'bar'))}}}
    enc = optimizers.ModelParamTraversal(lambda p, _: p.startswith('/enc'))
    dec = optimizers.ModelParamTraversal(lambda p, _: p.startswith('/dec'))
    a1 = adafactor.Adafactor(0.1, logical_factor_rules={'embed': F.ROW, 'mlp': F.COLUMN})
    a2 = adafactor.Adafactor(0.2, logical_factor_rules=dec_rules or {'foo': F.ROW,
                                                                     'bar': F.COLUMN})
    return variables, optimizers.MultiOptimizer([(enc, a1), (dec, a2)]), a1, a2


def _two_part_state():
    from ctrainstate.t5x.train_state import FlaxOptimTrainState
    variables, mo, a1, a2 = _two_part()
    return FlaxOptimTrainState.create(mo, variables), mo, a1, a2


def test_multi_optimizer_set_param_axes_gives_each_its_subtree():
    """t5x MultiOptimizer.set_param_axes passes each sub-optimizer
    ``_subtree_from_traversal(focus, param_logical_axes)``: a sub-Adafactor's
    logical_factor_rules need cover only the params it optimizes (t5x_hf.md §1.3 MultiOptimizer
    "also has set_param_axes"). ctrainstate gave every sub-optimizer all the axes, so the
    encoder's Adafactor raised for the decoder's axis 'foo'."""
    F = adafactor.FactorDim
    _, _, a1, a2 = _two_part_state()
    assert a1.hyper_params.factor_map == {'enc/kernel': (F.ROW, F.COLUMN)}
    assert a2.hyper_params.factor_map == {'dec/kernel': (F.ROW, F.COLUMN)}


def test_multi_optimizer_hyper_params_and_overrides_combine():
    """t5x MultiOptimizer.update_hyper_params: ``hps = overrides.pop('hyper_params',
    self.hyper_params)``, then the remaining overrides are applied to each of them
    (t5x_hf.md §1.3). ctrainstate dropped the overrides when hyper_params= was given."""
    _, mo, a1, a2 = _two_part_state()
    hps = mo.update_hyper_params(hyper_params=[a1.hyper_params, a2.hyper_params],
                                 learning_rate=0.5)
    assert [h.learning_rate for h in hps] == [0.5, 0.5]
    assert [h.learning_rate for h in mo.update_hyper_params(learning_rate=0.3)] == [0.3, 0.3]
    assert [h.learning_rate for h in mo.update_hyper_params()] == [0.1, 0.2]


# --- t5x.partitioning.PjitPartitioner ------------------------------------------------------------

def test_data_layout_when_batch_is_not_sharded():
    """t5x BasePartitioner.get_data_layout: with no data axis (the rules leave 'batch'
    unsharded) it returns ``DataLayout(batch_size=batch_size, shard_id=0, num_shards=1,
    is_first_host_in_replica_set=process_index == 0)``, the batch size as given (t5x_hf.md
    §1.1 get_data_layout). ctrainstate made the default batch size 1."""
    from ctrainstate.t5x import partitioning
    p = partitioning.PjitPartitioner(num_partitions=1,
                                     logical_axis_rules=(('embed', None), ('mlp', 'model')))
    assert p.data_partition_spec == P(None)
    assert p.get_data_layout() == partitioning.DataLayout(
        batch_size=None, shard_id=0, num_shards=1, is_first_host_in_replica_set=True)
    assert p.get_data_layout(7).batch_size == 7
    # with the standard rules the default is still the data mesh size (F-P7)
    assert partitioning.PjitPartitioner(num_partitions=1).get_data_layout().batch_size == 1


def test_partitioned_fn_lower_and_compile():
    """t5x PjittedFnWithContext has ``lower_and_compile(*args)`` (PjitPartitioner.compile calls
    it); ctrainstate's had only ``lower`` (AttributeError)."""
    from ctrainstate.t5x import partitioning
    p = partitioning.PjitPartitioner(num_partitions=1)
    fn = p.partition(lambda x: x * 2, (P('model'),), P('model'))
    x = np.arange(16, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(fn.lower_and_compile(x)(x)), x * 2)


# --- hf.partitions.set_partitions --------------------------------------------------------------------

def test_set_partitions_defaults_to_the_gpt_neo_table():
    """HF partitions.py: ``set_partitions(in_dict)`` takes only the params and applies
    ``_get_partition_rules()``, the GPT-Neo table (t5x_hf.md §1.7, §2.5; F-H1). ctrainstate
    required the rules (TypeError on the original call)."""
    from ctrainstate.hf.partitions import set_partitions
    z = np.zeros
    params = {'transformer': {
        'wte': {'embedding': z((16, 4))}, 'wpe': {'embedding': z((8, 4))},
        'h': {'0': {'attn': {'attention': {'q_proj': {'kernel': z((4, 4))},
                                           'out_proj': {'kernel': z((4, 4)), 'bias': z(4)}}},
                    'mlp': {'c_fc': {'kernel': z((4, 8)), 'bias': z(8)},
                            'c_proj': {'kernel': z((8, 4)), 'bias': z(4)}},
                    'ln_1': {'scale': z(4), 'bias': z(4)}}},
        'ln_f': {'scale': z(4), 'bias': z(4)}}}
    t = set_partitions(params)['transformer']
    assert t['wte']['embedding'] == P('mp', None) and t['wpe']['embedding'] == P('mp', None)
    h = t['h']['0']
    assert h['attn']['attention']['q_proj']['kernel'] == P(None, 'mp')
    assert h['attn']['attention']['out_proj'] == {'kernel': P('mp', None), 'bias': None}
    assert h['mlp']['c_fc'] == {'kernel': P(None, 'mp'), 'bias': P('mp')}
    assert h['mlp']['c_proj'] == {'kernel': P('mp', None), 'bias': None}
    assert h['ln_1'] == {'scale': None, 'bias': None} and t['ln_f'] == {'scale': None, 'bias': None}


# --- t5x.train_state ------------------------------------------------------------------------------

def test_as_logical_axes_keeps_flax_mutables_axes():
    """t5x FlaxOptimTrainState.as_logical_axes returns
    ``FlaxOptimTrainState(_optimizer=..., flax_mutables=get_axis_names(axes),
    flax_mutables_axes=self.flax_mutables_axes)`` (params_axes None, F-T10); ctrainstate set
    flax_mutables_axes to None, so ``partitioner.get_mesh_axes(state).flax_mutables_axes``
    differed from t5x's. The metadata has no leaves, so the axes still serve as a pjit spec."""
    from ctrainstate.partitioning import AxisMetadata
    from ctrainstate.t5x import partitioning
    from ctrainstate.t5x.train_state import FlaxOptimTrainState
    axes = {'dense': {'output_grad_axes': AxisMetadata(('mlp',))}}
    s = FlaxOptimTrainState.create(optimizers.adam(0.1), {
        'params': {'w': np.ones(16, np.float32)},
        'params_axes': {'w_axes': AxisMetadata(('mlp',))},
        'grads': {'dense': {'output_grad': np.zeros(16, np.float32)}}, 'grads_axes': axes})
    la = s.as_logical_axes()
    assert la.params_axes is None
    assert la.flax_mutables_axes == {'grads': axes}
    p = partitioning.PjitPartitioner(num_partitions=1)
    ma = p.get_mesh_axes(s)
    assert ma.flax_mutables_axes == {'grads': axes}
    assert ma.flax_mutables == {'grads': {'dense': {'output_grad': P('model')}}}
    moved = p.move_params_to_devices(s, ma)
    assert moved.flax_mutables['grads']['dense']['output_grad'].sharding.spec == P('model')


# --- hf.train_state: flax.training.common_utils helpers ----------------------------------------

def test_onehot_matches_flax():
    """flax.training.common_utils.onehot (t5x_hf.md §1.5 "onehot, get_metrics, stack_forest:
    helpers used by HF"): float32, a new last axis, on/off values. ctrainstate.hf had none."""
    common_utils = pytest.importorskip('flax.training.common_utils')
    labels = np.array([[1, 3, 0], [2, 2, 4]], np.int32)
    for kw in ({}, {'on_value': 0.9, 'off_value': 0.025}):
        want = np.asarray(common_utils.onehot(labels, 5, **kw))
        got = hf.onehot(cts.device_put(labels), 5, **kw)
        assert got.dtype == np.float32 and got.shape == want.shape == (2, 3, 5)
        np.testing.assert_array_equal(np.asarray(got), want)
        np.testing.assert_array_equal(np.asarray(hf.onehot(labels, 5, **kw)), want)


def test_get_metrics_and_stack_forest_match_flax():
    """flax's get_metrics: copy 0 of each replicated leaf, on the host, stacked over the
    list of steps; stack_forest stacks matching leaves (t5x_hf.md §1.5, §3.3 step 8)."""
    common_utils = pytest.importorskip('flax.training.common_utils')
    jax_utils = pytest.importorskip('flax.jax_utils')
    steps = [{'loss': np.float32(1.5 + i), 'acc': np.array([i, 2 * i], np.float32)}
             for i in range(3)]
    want = common_utils.get_metrics([jax_utils.replicate(m) for m in steps])
    got = hf.get_metrics([hf.replicate(m) for m in steps])
    for k in ('loss', 'acc'):
        assert np.shape(got[k]) == np.shape(want[k]) and got[k].dtype == want[k].dtype
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
    want = common_utils.stack_forest(steps)
    got = hf.stack_forest(steps)
    for k in ('loss', 'acc'):
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))


# --- user errors -------------------------------------------------------------------------------

def test_placement_error_names_the_param_path():
    """A param the mesh does not divide (width 6 on model=8): jax says only that a dimension
    is not divisible; DESIGN.md asks for errors that name the parameter path. The message
    names the state path of the value, its shape and its spec."""
    from ctrainstate.partitioning import AxisMetadata
    from ctrainstate.t5x import partitioning, utils

    def init_fn(rng, input_shapes, input_types=None):
        return {'params': {'dense': {'kernel': np.ones((4, 6), np.float32)}},
                'params_axes': {'dense': {'kernel_axes': AxisMetadata(('embed', 'mlp'))}}}
    p = partitioning.PjitPartitioner(num_partitions=1)
    init = utils.TrainStateInitializer(optimizers.sgd(0.1), init_fn, {}, p)
    with pytest.raises(ValueError, match=r"pjit out_axis_resources: \._optimizer\.target"
                                         r"\['dense'\]\['kernel'\] \(shape \(4, 6\), spec "
                                         r"PartitionSpec\(None, 'model'\)\): dimension 1 of "
                                         r"size 6 is not divisible by mesh axis 'model'"):
        init.from_scratch(None)


def test_multi_optimizer_set_param_axes_failure_leaves_no_partial_state():
    """DESIGN.md: no partial state after a failed call. When the second sub-Adafactor has no
    factor rule for one of its axes, the first one's factor_map is not left set."""
    from ctrainstate.t5x.train_state import FlaxOptimTrainState
    variables, mo, a1, a2 = _two_part({'foo': adafactor.FactorDim.ROW})
    with pytest.raises(ValueError, match="no logical_factor_rules entry for axis 'bar'"):
        FlaxOptimTrainState.create(mo, variables)
    assert a1.hyper_params.factor_map is None and a2.hyper_params.factor_map is None


def test_t5x_chain_takes_a_sequence():
    """t5x optimizers.py: ``def chain(transformations: Sequence[GradientTransformation]):
    return optax.chain(*transformations)``, wrapped (t5x_hf.md §1.3 ready-made wrappers).
    ctrainstate's chain was optax's varargs one, so t5x's ``chain([clip, sgd])`` failed
    ('list' object has no attribute 'init')."""
    o = optimizers.chain([optim.clip_by_global_norm(1.0), optim.sgd(0.5)])
    opt = o.create({'w': np.ones(2, np.float32)})
    opt = opt.apply_gradient({'w': np.full(2, 3.0, np.float32)})
    # by hand: |g| = 3 sqrt(2) is clipped to 1, so g = 1/sqrt(2) each; w = 1 - 0.5 / sqrt(2)
    np.testing.assert_allclose(np.asarray(opt.target['w']), 1 - 0.5 / np.sqrt(2), rtol=1e-6)


def test_t5x_partitioning_module_names():
    """t5x.partitioning defines ``LogicalAxisRules`` and ``HardwareMesh`` (used in scripts'
    annotations, e.g. ``def rules() -> partitioning.LogicalAxisRules``) and ``pjit(fn,
    in_axis_resources, out_axis_resources, static_argnums, donate_argnums, backend)``; a port
    that touched them failed with AttributeError."""
    from ctrainstate.t5x import partitioning
    assert partitioning.LogicalAxisRules is not None and partitioning.HardwareMesh is not None
    p = partitioning.PjitPartitioner(num_partitions=1)
    f = partitioning.pjit(lambda x: x + 1, in_axis_resources=(P('model'),),
                          out_axis_resources=P('model'), backend=None)
    with p.mesh:
        y = f(np.zeros(8, np.float32))
    assert y.sharding.spec == P('model')
    np.testing.assert_array_equal(np.asarray(y), 1.0)


def test_optax_wrapper_state_dict_drops_empty_dicts_in_the_state_only():
    """t5x OptaxWrapper.state_dict flattens/unflattens ``to_state_dict(state)`` (removing the
    empty dicts of EmptyState) and returns ``{'target': to_state_dict(target), 'state': ...}``
    (t5x_hf.md §1.3): the target keeps an empty subtree. ctrainstate dropped it too."""
    opt = optimizers.adam(0.1).create({'a': {}, 'b': {'w': np.ones(2, np.float32)}})
    sd = opt.state_dict()
    assert set(sd['target']) == {'a', 'b'} and sd['target']['a'] == {}
    assert set(sd['state']['param_states']['0']) == {'count', 'mu', 'nu'}
    assert 'a' not in sd['state']['param_states']['0']['mu']
    assert '1' not in sd['state']['param_states']
    back = opt.restore_state(sd)
    assert back.target['a'] == {}
    np.testing.assert_array_equal(np.asarray(back.target['b']['w']), 1.0)


@pytest.mark.parametrize('rules,where', [
    (('batch', 'data'), r"logical_axis_rules\[0\] = 'batch'"),   # one pair, not a sequence
    ((('batch', 'data', 'model'),), r"logical_axis_rules\[0\] = \('batch', 'data', 'model'\)"),
    ((('batch',),), r"logical_axis_rules\[0\] = \('batch',\)"),
    ((('batch', 'data'), (1, 'model')), r"logical_axis_rules\[1\] = \(1, 'model'\)"),
    ('batch', r"logical_axis_rules = 'batch'"),
])
def test_malformed_rules_are_named(rules, where):
    """A rule is a (logical_name, mesh_axes) pair (t5x_hf.md §2.1, §2.4). t5x crashes later
    ('too many values to unpack') on a malformed one; ctrainstate turned each rule into a
    tuple first, so a bare 'foo' became the rule ('f', 'o', 'o') in its error. The error now
    names the rule as given."""
    from ctrainstate.t5x import partitioning
    with pytest.raises(ValueError, match=where + '.*(logical_name, mesh_axes)'):
        partitioning.PjitPartitioner(num_partitions=1, logical_axis_rules=rules)


def test_additional_rules_must_be_pairs():
    """``additional_rules`` is a sequence of pairs appended to the table (F-S1); a single
    pair given as the sequence used to add the strings 'foo' and 'model' as rules."""
    from ctrainstate.t5x import partitioning
    with pytest.raises(ValueError, match=r"additional_rules\[0\] = 'foo' is not a "
                                         r"\(logical_name, mesh_axes\) pair"):
        partitioning.standard_logical_axis_rules(additional_rules=('foo', 'model'))
    rules = partitioning.standard_logical_axis_rules(additional_rules=[('foo', 'model')])
    assert rules[-1] == ('foo', 'model') and len(rules) == 14


def test_set_partitions_rule_with_a_string_instead_of_a_tuple():
    """``(('wte'), P('mp', None))`` is the classic missing comma: HF's ``_match`` then
    compiles each *character* as a regex (t5x_hf.md §1.7: one regex per key of a window), so
    the rule silently matches windows of one-letter keys. ctrainstate raises and says how to
    write the rule; a rule that is not a pair is named too."""
    from ctrainstate.hf.partitions import set_partitions
    params = {'transformer': {'wte': {'embedding': np.zeros((8, 4))}}}
    with pytest.raises(ValueError, match=r"partition rule 0: the regexes 'wte' are one string"
                                         r".*write \('wte',\)"):
        set_partitions(params, [(('wte'), P('mp', None))])
    with pytest.raises(ValueError, match=r"partition rule 1 = \('embedding',\) is not a "
                                         r"\(regex_tuple, spec\) pair"):
        set_partitions(params, [(('wte',), None), ('embedding',)])
    assert set_partitions(params, [(('wte',), P('mp', None))]) == {
        'transformer': {'wte': {'embedding': P('mp', None)}}}


def test_shard_names_a_batch_that_does_not_divide():
    """flax's shard reshapes to (local_device_count, -1, ...) and numpy's reshape error names
    neither the leaf nor the device count; ctrainstate names both."""
    n = cts.local_device_count()
    ok = hf.shard({'ids': np.zeros((2 * n, 3))})
    assert ok['ids'].shape == (n, 2, 3)
    with pytest.raises(ValueError, match=r"shard: \['labels'\] has shape \(%d, 3\); its leading "
                                         r"dimension must divide by the %d local devices"
                                         % (n + 1, n)):
        hf.shard({'ids': np.zeros((2 * n, 3)), 'labels': np.zeros((n + 1, 3))})


class _PlainSGD(optimizers.OptimizerDef):
    """A per-param OptimizerDef without derive_logical_axes (a user's own, or flax.optim's)."""

    def __init__(self, lr):
        super().__init__(optimizers._OptaxHyperParams(lr))

    def init_param_state(self, param):
        return {}

    def apply_param_gradient(self, step, hp, param, state, grad):
        return param - hp.learning_rate * grad, state


def test_multi_optimizer_axes_skip_a_sub_optimizer_without_derive():
    """t5x MultiOptimizer.derive_logical_axes derives only for sub-optimizers that have
    ``derive_logical_axes`` (``if hasattr(opt_def, 'derive_logical_axes')``); the params of
    the others get None. ctrainstate raised AttributeError."""
    from ctrainstate.partitioning import AxisMetadata
    from ctrainstate.t5x import partitioning
    from ctrainstate.t5x.train_state import FlaxOptimTrainState
    F = adafactor.FactorDim
    variables = {
        'params': {'enc': {'kernel': np.ones((4, 8), np.float32)},
                   'dec': {'kernel': np.ones((8, 16), np.float32)}},
        'params_axes': {'enc': {'kernel_axes': AxisMetadata(('embed', 'mlp'))},
                        'dec': {'kernel_axes': AxisMetadata(('embed', 'mlp'))}}}
    enc = optimizers.ModelParamTraversal(lambda p, _: p.startswith('/enc'))
    dec = optimizers.ModelParamTraversal(lambda p, _: p.startswith('/dec'))
    a1 = adafactor.Adafactor(0.1, beta1=0.9,
                             logical_factor_rules={'embed': F.ROW, 'mlp': F.COLUMN})
    mo = optimizers.MultiOptimizer([(enc, a1), (dec, _PlainSGD(0.5))])
    s = FlaxOptimTrainState.create(mo, variables)
    la = s.as_logical_axes()
    assert la.param_states['dec']['kernel'] is None
    assert la.param_states['enc']['kernel'].m == P('embed', 'mlp')
    assert la.params['dec']['kernel'] == P('embed', 'mlp')
    ma = partitioning.PjitPartitioner(num_partitions=1).get_mesh_axes(s)
    assert ma.params['dec']['kernel'] == P(None, 'model')


@pytest.mark.filterwarnings('ignore:`flax.traverse_util.Traversal` will be deprecated')
def test_model_param_traversal_in_traverse_util_matches_flax():
    """t5x's MultiOptimizer docstring (t5x_hf.md §1.3) builds its traversals with
    ``flax.traverse_util.ModelParamTraversal``; ``from ctrainstate import traverse_util``
    had none. iterate/update compare with live flax; the traversal drives MultiOptimizer."""
    flax_tu = pytest.importorskip('flax.traverse_util')
    from ctrainstate import traverse_util
    params = {'dense': {'kernel': 1.0, 'bias': 2.0}, 'a': {'kernel': 3.0}, 'e': {}}
    for f in (lambda p, _: 'kernel' in p, lambda p, v: p.startswith('/dense') or v > 2.5):
        ours, theirs = traverse_util.ModelParamTraversal(f), flax_tu.ModelParamTraversal(f)
        assert list(ours.iterate(params)) == list(theirs.iterate(params))
        assert ours.update(lambda x: -x, params) == theirs.update(lambda x: -x, params)
    kernels = traverse_util.ModelParamTraversal(lambda path, _: 'kernel' in path)
    biases = traverse_util.ModelParamTraversal(lambda path, _: 'bias' in path)
    mo = optimizers.MultiOptimizer([(kernels, adafactor.Adafactor(0.1)),
                                    (biases, adafactor.Adafactor(0.2))])
    opt = mo.create({'dense': {'kernel': np.ones((2, 2), np.float32),
                               'bias': np.ones(2, np.float32)}})
    assert set(opt.state.param_states['dense']) == {'kernel', 'bias'}


@pytest.mark.parametrize('ici,dcn', [((1, 2, 4), (1, 1)), ((2, 4), (1, 1))])
def test_multislice_shapes_need_one_entry_per_mesh_axis(ici, dcn):
    """Multi-slice meshes have the axes ('replica', 'data', 'model') (t5x_hf.md §1.1
    default_mesh (1)), so both shapes have 3 entries. ctrainstate zipped shapes of different
    lengths, then reported a device count ('mesh_shape (1, 2) needs 2 devices') or a rank
    mismatch of names instead of the shapes' lengths."""
    from ctrainstate.t5x import partitioning
    p = partitioning.PjitPartitioner(num_partitions=1, ici_mesh_shape=ici, dcn_mesh_shape=dcn)
    with pytest.raises(ValueError, match=r"must each have 3 entries, one per mesh axis "
                                         r"\('replica', 'data', 'model'\)"):
        p.mesh


def test_replace_params_of_another_tree_is_an_error():
    """FlaxOptimTrainState.replace_params swaps the optimizer target (t5x_hf.md §1.2, F-T7).
    With params of other paths, jax's optax update fails on the mismatched trees; ctrainstate's
    fused step silently updated 'v' with the state kept for 'w'. The swap itself now raises,
    naming the paths or the shape, and leaves the state usable."""
    from ctrainstate.t5x.train_state import FlaxOptimTrainState
    s = FlaxOptimTrainState.create(optimizers.adam(0.1), {'params': {'w': np.ones(4, np.float32)}})
    with pytest.raises(ValueError, match=r"missing \['w'\], unexpected \['v'\]"):
        s.replace_params({'v': np.ones(4, np.float32)})
    with pytest.raises(ValueError, match=r"replace_params: w has shape \(5,\), the optimizer "
                                         r"state is for shape \(4,\)"):
        s.replace_params({'w': np.ones(5, np.float32)})
    s2 = s.replace_params({'w': np.zeros(4, np.float32)}).apply_gradient(
        {'w': np.ones(4, np.float32)}, learning_rate=0.1)
    # by hand: adam's first step moves each weight by -lr (unit gradients)
    np.testing.assert_allclose(np.asarray(s2.params['w']), -0.1, rtol=1e-5)
