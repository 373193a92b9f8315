"""FlaxOptimTrainState / InferenceState facts (reference t5x_hf.md §1.2, F-T1..F-T13)."""
import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import P
from ctrainstate.core import FrozenDict, freeze, unfreeze
from ctrainstate.partitioning import AxisMetadata
from ctrainstate.t5x import adafactor, optimizers
from ctrainstate._src.ports.t5x import optimizers as _t5x_optimizers   # _OptaxHyperParams
from ctrainstate.t5x.train_state import EMPTY_DICT, FlaxOptimTrainState, InferenceState


def host(tree):
    return cts.tree_util.tree_map(lambda x: np.asarray(x), tree)


def eq(a, b):
    fa, ta = cts.tree_util.tree_flatten(host(a))
    fb, tb = cts.tree_util.tree_flatten(host(b))
    assert ta == tb, (ta, tb)
    for x, y in zip(fa, fb):
        np.testing.assert_array_equal(x, y)


VARS = {'params': {'dense': {'bias': np.zeros(4, np.float32),
                             'kernel': np.zeros((2, 4), np.float32)}}}
AXES = {'dense': {'bias_axes': AxisMetadata(('embed',)),
                  'kernel_axes': AxisMetadata(('vocab', 'embed'))}}


def test_constructor_with_mutables():  # F-T1
    params = {'test': np.ones(10, np.float32)}
    opt = optimizers.adam(0.1).create(params)
    s = FlaxOptimTrainState(opt, flax_mutables={'flax_mutable1': np.ones(10, np.float32)})
    assert int(s.step) == 0
    eq(s.state_dict()['flax_mutables'], {'flax_mutable1': np.ones(10, np.float32)})
    eq(s.params, params)
    assert s.param_states is opt.state.param_states


def test_create_splits_mutables():  # F-T2
    opt_def = optimizers.sgd(0.42)
    s = FlaxOptimTrainState.create(opt_def, dict(VARS, mutables=np.ones(3, np.float32)))
    assert int(s.step) == 0
    eq(unfreeze(s.flax_mutables), {'mutables': np.ones(3, np.float32)})
    assert s.params_axes is None and s.flax_mutables_axes is None
    assert s._optimizer.optimizer_def is opt_def


def test_create_with_axes_sets_factor_map():  # F-T3
    F = adafactor.FactorDim
    opt_def = adafactor.Adafactor(0.1, logical_factor_rules={'vocab': F.COLUMN, 'embed': F.ROW})
    s = FlaxOptimTrainState.create(opt_def, dict(VARS, params_axes=AXES))
    assert opt_def.hyper_params.factor_map == {'dense/bias': (F.NONE,),
                                               'dense/kernel': (F.COLUMN, F.ROW)}
    assert s.flax_mutables == {} and s.params_axes == AXES


def test_create_mutables_axes():  # F-T4
    grads_axes = {'dense': {'output_grad_axes': AxisMetadata(('embed',))}}
    s = FlaxOptimTrainState.create(optimizers.sgd(0.1), dict(
        VARS, params_axes=AXES, grads={'dense': {'output_grad': np.zeros(4, np.float32)}},
        grads_axes=grads_axes))
    assert list(s.flax_mutables) == ['grads']
    assert s.flax_mutables_axes['grads'] == grads_axes


def test_create_requires_axes_for_adafactor():  # F-T5
    with pytest.raises(ValueError, match='The optimizer supports params_axes for model-based '
                                         'partitioning, but the model is not emitting them.'):
        FlaxOptimTrainState.create(adafactor.Adafactor(0.1), VARS)


def test_missing_axis_names():  # F-T6
    axes = {'dense': {'bias_axes': AxisMetadata(('embed',))}}
    with pytest.raises(ValueError, match=r"Missing axis names for parameters: \{'dense/kernel'\}"):
        FlaxOptimTrainState.create(optimizers.sgd(0.1), dict(VARS, params_axes=axes))
    with pytest.raises(ValueError, match=r"Missing axis names for parameters: \{'dense/kernel'\}"):
        InferenceState.create(dict(VARS, params_axes=axes))


def test_replace_params_and_step():  # F-T7, F-T8
    s = FlaxOptimTrainState(optimizers.adam(0.1).create({'test': np.ones(10, np.float32)}))
    before = s.state_dict()
    s2 = s.replace_params({'test': np.zeros(10, np.float32)})
    after = s2.state_dict()
    eq(after['target'], {'test': np.zeros(10, np.float32)})
    eq(after['state'], before['state'])
    assert int(s.replace_step(np.array(1, np.int32)).step) == 1


class _RecordingDef(optimizers.OptimizerDef):
    def __init__(self):
        super().__init__(_t5x_optimizers._OptaxHyperParams())
        self.calls = []

    def init_state(self, params):
        return optimizers.OptimizerState(0, {})

    def apply_gradient(self, hyper_params, params, state, grads):
        self.calls.append((grads, hyper_params.learning_rate))
        return 'new_params', optimizers.OptimizerState(1, {})


def test_apply_gradient_calls_optimizer_once_and_resets_mutables():  # F-T9
    d = _RecordingDef()
    s = FlaxOptimTrainState(optimizers.Optimizer(d, d.init_state(None), 'params'),
                            flax_mutables={'old': 1})
    new = s.apply_gradient(grads=42, learning_rate=43, flax_mutables={'test': 44})
    assert d.calls == [(42, 43)]
    assert new.params == 'new_params' and new.step == 1 and new.flax_mutables == {'test': 44}
    assert new == FlaxOptimTrainState(optimizers.Optimizer(d, optimizers.OptimizerState(1, {}),
                                                           'new_params'),
                                      flax_mutables={'test': 44})
    assert s.apply_gradient(grads=1, learning_rate=2).flax_mutables == EMPTY_DICT


def test_apply_gradient_stores_non_mapping_mutables_as_given():
    """t5x stores flax_mutables as passed (None included). It is converted before the
    in-place step, so nothing can fail once the old state's arrays are donated."""
    d = _RecordingDef()
    s = FlaxOptimTrainState(optimizers.Optimizer(d, d.init_state(None), 'params'))
    assert s.apply_gradient(grads=1, learning_rate=2, flax_mutables=None).flax_mutables is None
    opt = optimizers.adam(0.1).create({'w': np.ones(4, np.float32)})
    s = FlaxOptimTrainState(opt).apply_gradient({'w': np.ones(4, np.float32)},
                                                learning_rate=0.1, flax_mutables=None)
    assert s.flax_mutables is None and int(s.step) == 1
    np.testing.assert_allclose(np.asarray(s.params['w']), 0.9, rtol=1e-6)


def test_as_logical_axes():  # F-T10
    grads_axes = {'dense': {'output_grad_axes': AxisMetadata(('embed',))}}
    s = FlaxOptimTrainState.create(optimizers.adam(0.1), dict(
        VARS, params_axes=AXES, grads={'dense': {'output_grad': np.zeros(4, np.float32)}},
        grads_axes=grads_axes))
    la = s.as_logical_axes()
    assert la.params_axes is None
    assert la.params == {'dense': {'bias': P('embed'), 'kernel': P('vocab', 'embed')}}
    assert la.flax_mutables == {'grads': {'dense': {'output_grad': P('embed')}}}
    mu = la.param_states[0].mu
    assert mu == la.params and la.param_states[0].count is None and la.step is None
    s2 = FlaxOptimTrainState.create(optimizers.adam(0.1), dict(VARS, params_axes=AXES))
    assert s2.as_logical_axes().flax_mutables == {}


def test_as_logical_axes_needs_derive():
    d = _RecordingDef()
    s = FlaxOptimTrainState(optimizers.Optimizer(d, d.init_state(None), {}))
    with pytest.raises(ValueError, match="Optimizer '_RecordingDef' requires a "
                                         "`derive_logical_axes` method"):
        s.as_logical_axes()


def _adafactor_state():
    return FlaxOptimTrainState.create(
        adafactor.Adafactor(0.42),
        {'params': {'kernel': np.zeros((2, 4), np.float32)},
         'params_axes': {'kernel_axes': AxisMetadata(('vocab', 'embed'))},
         'mutables': np.ones(3, np.float32)})


def test_state_dict_adafactor():  # F-T11
    sd = _adafactor_state().state_dict()
    eq(sd, {'state': {'step': np.int32(0),
                      'param_states': {'kernel': {'m': np.zeros(1), 'v': np.zeros((2, 4)),
                                                  'v_col': np.zeros(1), 'v_row': np.zeros(1)}}},
            'target': {'kernel': np.zeros((2, 4))},
            'flax_mutables': {'mutables': np.ones(3)}})


def test_restore_state():  # F-T12
    s = _adafactor_state()
    ones = lambda *sh: np.ones(sh, np.float32)  # noqa: E731
    r = s.restore_state({
        'state': {'step': np.int32(1),
                  'param_states': {'kernel': {'m': ones(1), 'v': ones(2, 4), 'v_col': ones(1),
                                              'v_row': ones(1)}}},
        'target': {'kernel': ones(2, 4)},
        'flax_mutables': {'mutables': np.zeros(3, np.float32)}})
    assert int(r.step) == 1
    eq(r.params, {'kernel': ones(2, 4)})
    eq(r.param_states['kernel'].v, ones(2, 4))
    eq(unfreeze(r.flax_mutables), {'mutables': np.zeros(3)})
    assert r.params_axes == s.params_axes


def test_inference_state():  # F-T13
    s = InferenceState.create(dict(VARS, params_axes=AXES))
    assert int(s.step) == 0 and s.params_axes == AXES
    s0 = InferenceState.create(VARS)
    sd = s0.state_dict()
    assert set(sd) == {'state', 'target'} and int(sd['state']['step']) == 0
    r = s0.restore_state({'state': {'step': 10}, 'target': host(s0.params),
                          'flax_mutables': {'m': np.ones(1)}})
    assert r.step == 10 and list(r.flax_mutables) == ['m']
    r2 = s0.restore_state({'state': {'step': 10}, 'target': host(s0.params)})
    assert r2.flax_mutables == EMPTY_DICT and r2.params_axes is None
    with pytest.raises(NotImplementedError):
        s0.apply_gradient({}, 0.1)
    with pytest.raises(NotImplementedError):
        s0.param_states
    la = s.as_logical_axes()
    assert la.step is None and la.params['dense']['kernel'] == P('vocab', 'embed')


def test_apply_gradient_trains_sharded_state():
    """A real step under a mesh: state born sharded stays sharded, values match a host Adam."""
    from ctrainstate.t5x import partitioning
    p = partitioning.PjitPartitioner(num_partitions=1)
    s = FlaxOptimTrainState.create(optimizers.adam(0.1),
                                   dict(params={'w': np.ones((8, 4), np.float32)},
                                        params_axes={'w_axes': AxisMetadata(('vocab', 'embed'))}))
    axes = p.get_mesh_axes(s)
    s = p.move_params_to_devices(s, axes)
    step = p.partition(lambda st, g: st.apply_gradient(g, learning_rate=0.5),
                       (axes, None), axes)
    s = step(s, {'w': np.full((8, 4), 2.0, np.float32)})
    assert int(s.step) == 1
    assert s.params['w'].sharding.spec == P('model', None)
    assert s.param_states[0].nu['w'].sharding.spec == P('model', None)
    # adam, first step: update = lr * g/(|g|+eps) = 0.1 (the 0.5 passed in is ignored, F-O5)
    np.testing.assert_allclose(np.asarray(s.params['w']), 0.9, rtol=1e-6)


# --- FrozenDicts where t5x has them ------------------------------------------------------------

def test_create_restore_and_as_logical_axes_give_frozen_dicts_as_t5x():
    """t5x freezes the mutables and their axes in create and restore_state; as_logical_axes
    gives get_axis_names' FrozenDicts; an InferenceState takes the checkpoint's params as they
    are (frozen), not fitted to its own."""
    grads_axes = {'dense': {'output_grad_axes': AxisMetadata(('embed',))}}
    variables = dict(VARS, params_axes=AXES, grads={'dense': {'output_grad': np.ones(4)}},
                     grads_axes=grads_axes)
    s = FlaxOptimTrainState.create(optimizers.sgd(0.1), variables)
    assert type(s.flax_mutables) is FrozenDict and type(s.flax_mutables_axes) is FrozenDict
    assert type(EMPTY_DICT) is FrozenDict and EMPTY_DICT == {}
    assert s.params_axes is AXES     # as given (t5x's pop)
    la = s.as_logical_axes()
    assert type(la.flax_mutables) is FrozenDict
    assert la.flax_mutables == {'grads': {'dense': {'output_grad': P('embed')}}}
    la0 = FlaxOptimTrainState.create(optimizers.sgd(0.1), dict(VARS, params_axes=AXES))
    assert type(la0.as_logical_axes().flax_mutables) is FrozenDict
    frozen = FlaxOptimTrainState.create(optimizers.sgd(0.1),
                                        freeze(dict(VARS, params_axes=AXES))).as_logical_axes()
    assert type(frozen.params) is FrozenDict and frozen.params == {
        'dense': {'bias': P('embed'), 'kernel': P('vocab', 'embed')}}
    r = s.restore_state(dict(s.state_dict(), flax_mutables={'m': np.zeros(1)}))
    assert type(r.flax_mutables) is FrozenDict
    assert type(s.restore_state(s.state_dict()).flax_mutables) is FrozenDict

    inf = InferenceState.create(dict(VARS, params_axes=AXES))
    assert type(inf.flax_mutables) is FrozenDict
    la = inf.as_logical_axes()
    assert type(la.params) is FrozenDict and type(la.flax_mutables) is FrozenDict
    # the checkpoint's params, whatever this state held (another shape, another key)
    ckpt = {'dense': {'kernel': np.ones((3, 5), np.float32)}, 'extra': {'w': np.ones(2)}}
    r = inf.restore_state({'state': {'step': 7}, 'target': ckpt})
    assert type(r.params) is FrozenDict and r.params['dense']['kernel'].shape == (3, 5)
    assert r.params['extra']['w'] is ckpt['extra']['w'] and r.step == 7


def test_create_keeps_flax_mutables_as_given():
    """t5x stores the mutables it is given (frozen); they were copied to devices."""
    m = np.ones(3, np.float32)
    s = FlaxOptimTrainState.create(optimizers.sgd(0.1), dict(VARS, mutables=m))
    assert s.flax_mutables['mutables'] is m


# --- regression tests for parity bugs found in FlaxOptimTrainState (shared/reference/t5x_hf.md)

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


def test_apply_gradient_under_jit_is_one_node_with_the_eager_bits():
    import ctrainstate.numpy as cnp
    rng = np.random.default_rng(2)
    variables = {'params': {'w': rng.standard_normal((3, 4)).astype(np.float32),
                            'b': np.zeros(4, np.float32)}}
    x = cts.device_put(rng.standard_normal((5, 3)).astype(np.float32))

    def make():
        v = cts.tree_util.tree_map(cts.device_put, variables)
        return FlaxOptimTrainState.create(optimizers.OptaxWrapper(
            cts.optim.adamw(1e-2, weight_decay=0.1)), v)

    def step(st, x):
        def loss_fn(p):
            return cnp.mean(cnp.square(cnp.tanh(x @ p['w'] + p['b'])))
        loss, grads = cts.value_and_grad(loss_fn)(st.params)
        return st.apply_gradient(grads, learning_rate=1e-2), loss   # (ignored by optax)

    e, j = make(), make()
    jstep = cts.jit(step)
    for _ in range(4):
        e, le = step(e, x)
        j, lj = jstep(j, x)
        assert np.asarray(le).tobytes() == np.asarray(lj).tobytes()
    assert jstep._programs.traces == 1
    eq(e.params, j.params)
    eq(e.param_states, j.param_states)
    assert int(np.asarray(j.step)) == int(np.asarray(e.step)) == 4
    text = jstep.lower(j, x).as_text()
    assert "optimizer_step[node]" in text and "not replayable" not in text
