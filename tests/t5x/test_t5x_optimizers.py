"""t5x optimizer facts (reference t5x_hf.md §1.3, F-O1..F-O6) and t5x Adafactor numerics."""
import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate.core import freeze
from ctrainstate import P, nn, optim, random
from ctrainstate.optim import EmptyState, MaskedNode, ScaleByAdamState
from ctrainstate.partitioning import AxisMetadata
from ctrainstate.t5x import adafactor, optimizers, partitioning, utils
from ctrainstate._src.ports.t5x import optimizers as _t5x_optimizers   # _OptaxHyperParams
from ctrainstate.t5x.train_state import FlaxOptimTrainState
from ctrainstate._src.base import dtypes as _dtypes

PARAMS = {'dense': {'bias': np.zeros(4, np.float32), 'kernel': np.ones((2, 4), np.float32)}}
AX = {'dense': {'bias': P('embed'), 'kernel': P('vocab', 'embed')}}


def test_adamw_derive_logical_axes():  # F-O1
    w = optimizers.OptaxWrapper(optim.adamw(0.001, weight_decay=0.001))
    opt = w.create(PARAMS)
    got = w.derive_logical_axes(opt, AX)
    assert got == optimizers.Optimizer(
        w, optimizers.OptimizerState(step=None, param_states=(
            ScaleByAdamState(count=None, mu=AX, nu=AX), EmptyState(), EmptyState())), target=AX)


def test_adamw_state_dict_and_restore():  # F-O2
    w = optimizers.adamw(0.001, weight_decay=0.001)
    opt = w.create(PARAMS)
    opt = opt.apply_gradient({'dense': {'bias': np.ones(4, np.float32),
                                        'kernel': np.ones((2, 4), np.float32)}})
    sd = opt.state_dict()
    shapes = cts.tree_util.tree_map(np.shape, sd)
    pshapes = {'dense': {'bias': (4,), 'kernel': (2, 4)}}
    assert shapes == {'target': pshapes, 'state': {'step': (), 'param_states': {
        '0': {'count': (), 'mu': pshapes, 'nu': pshapes}}}}
    fresh = w.create(PARAMS)
    back = fresh.restore_state(cts.tree_util.tree_map(np.asarray, sd))
    assert isinstance(back.state.param_states[1], EmptyState)
    assert int(back.state.step) == 1 and int(back.state.param_states[0].count) == 1
    for a, b in zip(cts.tree_util.tree_leaves(back.state_dict()), cts.tree_util.tree_leaves(sd)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize('make', [
    lambda: optimizers.sgd(0.1), lambda: optimizers.sgd(0.1, momentum=0.9),
    lambda: optimizers.adam(0.1), lambda: optimizers.adamw(0.1), lambda: optimizers.lion(0.1),
    lambda: optimizers.rmsprop(0.1), lambda: optimizers.rmsprop(0.1, momentum=0.9),
    lambda: optimizers.adagrad(0.1), lambda: optimizers.lamb(0.1),
    lambda: optimizers.fromage(0.1), lambda: optimizers.adabelief(0.1),
    lambda: optimizers.radam(0.1), lambda: optimizers.yogi(0.1),
    lambda: optimizers.lars(0.1, weight_decay=1e-3), lambda: optimizers.noisy_sgd(0.1, key=1),
    lambda: optimizers.OptaxWrapper(optim.inject_hyperparams(optim.adamw)(
        learning_rate=optim.linear_schedule(0.1, 0.0, 10))),
    lambda: optimizers.rmsprop(0.1, centered=True),
    lambda: optimizers.OptaxWrapper(optim.MultiSteps(optim.adam(0.1), 2).gradient_transformation()),
    lambda: optimizers.multi_transform({'a': optim.adam(0.1), 'b': optim.set_to_zero()},
                                       {'dense': {'bias': 'b', 'kernel': 'a'}}),
    lambda: optimizers.adafactor(0.1, min_dim_size_to_factor=2),
    lambda: optimizers.chain(optim.clip_by_global_norm(1.0), optim.adam(0.1)),
    lambda: optimizers.OptaxWrapper(optim.masked(optim.adam(0.1), {'dense': {'bias': False,
                                                                              'kernel': True}})),
])
def test_derive_logical_axes_for_each_optimizer(make):  # F-O3
    w = make()
    opt = w.create(PARAMS)
    axes = w.derive_logical_axes(opt, AX)
    # every state leaf with its own param's shape gets that param's axes; everything else None
    pl, _ = cts.tree_util.tree_flatten_with_path(opt.state.param_states)
    axes_leaves = cts.tree_util.tree_leaves(axes.state.param_states,
                                            is_leaf=lambda x: x is None or isinstance(x, P))
    assert len(pl) == len(axes_leaves)
    n_param_like = 0
    for (path, leaf), ax in zip(pl, axes_leaves):
        keys = [getattr(k, 'key', None) for k in path]
        name = keys[-1] if keys[-2:-1] == ['dense'] else None
        if name is not None and tuple(leaf.shape) == PARAMS['dense'][name].shape:
            assert ax == AX['dense'][name], (path, ax)
            n_param_like += 1
        else:
            assert ax is None, (path, ax)


def test_masked_state_keeps_masked_nodes():
    w = optimizers.OptaxWrapper(optim.masked(optim.adam(0.1), {'dense': {'bias': False,
                                                                          'kernel': True}}))
    axes = w.derive_logical_axes(w.create(PARAMS), AX).state.param_states
    mu = axes.inner_state[0].mu
    assert isinstance(mu['dense']['bias'], MaskedNode) and mu['dense']['kernel'] == AX['dense']['kernel']


def test_learning_rate_override_is_ignored():  # F-O5
    g = {'dense': {'bias': np.ones(4, np.float32), 'kernel': np.ones((2, 4), np.float32)}}
    outs = []
    for lr in (None, 0.5, 100.0):
        opt = optimizers.sgd(0.1).create(PARAMS)
        opt = opt.apply_gradient(g, learning_rate=lr) if lr is not None else opt.apply_gradient(g)
        outs.append(np.asarray(opt.target['dense']['kernel']))
    np.testing.assert_allclose(outs[0], 0.9, rtol=1e-6)
    assert all(np.array_equal(outs[0], o) for o in outs)


def test_multi_optimizer():  # F-O6
    kernels = optimizers.ModelParamTraversal(lambda path, _: 'kernel' in path)
    everything = optimizers.ModelParamTraversal(lambda path, _: True)
    F = adafactor.FactorDim
    rules = {'vocab': F.COLUMN, 'embed': F.ROW}
    with pytest.raises(ValueError, match='Multiple optimizers match the same leaves : '):
        optimizers.MultiOptimizer([(kernels, adafactor.Adafactor(0.1)),
                                   (everything, adafactor.Adafactor(0.1))]).init_state(PARAMS)
    m = optimizers.MultiOptimizer([(kernels, adafactor.Adafactor(0.1, logical_factor_rules=rules))])
    state = FlaxOptimTrainState.create(m, {'params': PARAMS, 'params_axes': {
        'dense': {'bias_axes': AxisMetadata(('embed',)),
                  'kernel_axes': AxisMetadata(('vocab', 'embed'))}}})
    assert state.param_states['dense']['bias'] is None
    assert int(state.step) == 0
    g = {'dense': {'bias': np.ones(4, np.float32), 'kernel': np.ones((2, 4), np.float32)}}
    s2 = state.apply_gradient(g, learning_rate=0.1)
    np.testing.assert_array_equal(np.asarray(s2.params['dense']['bias']), 0)  # not optimized
    assert np.all(np.asarray(s2.params['dense']['kernel']) < 1)
    assert int(s2.step) == 1
    la = state.as_logical_axes()
    assert la.param_states['dense']['bias'] is None
    assert la.param_states['dense']['kernel'].v == P('vocab', 'embed')
    hp = m.update_hyper_params(learning_rate=0.3)
    assert [h.learning_rate for h in hp] == [0.3]


@pytest.mark.parametrize('shape,min_dim', [((6, 8), 4), ((6, 8), 128), ((5,), 2)])
def test_t5x_adafactor_matches_optax_style_adafactor(shape, min_dim):
    """Without momentum/decay, t5x's Adafactor and optax's adafactor compute the same step
    (ctrainstate.optim.adafactor is tested against optax elsewhere)."""
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(shape).astype(np.float32)
    grads = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
    opt = adafactor.Adafactor(0.05, min_dim_size_to_factor=min_dim).create({'w': p0})
    tx = optim.adafactor(0.05, min_dim_size_to_factor=min_dim)
    p = {'w': cts.device_put(p0)}
    st = tx.init(p)
    for g in grads:
        opt = opt.apply_gradient({'w': g})
        u, st = tx.update({'w': g}, st, p)
        p = optim.apply_updates(p, u)
    np.testing.assert_allclose(np.asarray(opt.target['w']), np.asarray(p['w']), rtol=2e-5,
                               atol=1e-6)
    v = opt.state.param_states['w']
    assert (v.v.shape == (1,)) == (len(shape) == 2 and min(shape) >= min_dim)


def test_t5x_adafactor_momentum_and_decay_by_hand():
    """One step on a (1,)-factor-free vector, checked against the formula written out."""
    p0 = np.array([1.0, -2.0, 3.0], np.float32)
    g = np.array([0.5, 0.5, -1.0], np.float32)
    opt = adafactor.Adafactor(0.1, beta1=0.9, weight_decay_rate=0.01,
                              multiply_by_parameter_scale=False, clipping_threshold=None
                              ).create({'w': p0})
    opt = opt.apply_gradient({'w': g})
    decay = 1 - 1.0 ** -0.8  # step 0 -> t = 1 -> decay 0, mixing 1
    v = decay * 0 + (1 - decay) * (g * g + 1e-30)
    m = 0.9 * 0 + 0.1 * (0.1 * g / np.sqrt(v))
    np.testing.assert_allclose(np.asarray(opt.target['w']), 0.99 * p0 - m, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(opt.state.param_states['w'].m), m, rtol=1e-6)


def test_adafactor_incomplete_spec_and_rank_errors():
    F = adafactor.FactorDim
    a = adafactor.Adafactor(0.1, logical_factor_rules={'a': F.ROW, 'b': F.COLUMN, 'c': F.NONE})
    with pytest.raises(ValueError, match='Incomplete adafactor spec'):
        a.set_param_axes({'w': P('a', 'b', 'c')})
    with pytest.raises(ValueError, match="no logical_factor_rules entry for axis 'zz'"):
        a.set_param_axes({'w': P('a', 'zz')})
    with pytest.raises(ValueError, match='rank strictly higher than 2'):
        adafactor.Adafactor(0.1).create({'w': np.ones((2, 2, 2), np.float32)})


class Block(nn.Module):
    """A tiny T5-ish encoder/decoder of DenseGeneral layers with t5x logical axes."""

    @nn.compact
    def __call__(self, x):
        emb = nn.Embed(32, 8, embedding_axes=('vocab', 'embed'), name='token_embedder')
        h = emb(x)
        for part in ('encoder', 'decoder'):
            y = nn.DenseGeneral(16, kernel_axes=('embed', 'mlp'), use_bias=False,
                                name=f'{part}_wi')(h)
            y = nn.relu(y)
            h = h + nn.DenseGeneral(8, kernel_axes=('mlp', 'embed'), use_bias=False,
                                    name=f'{part}_wo')(y)
        return emb.attend(h)


DECODER = {'token_embedder': {'embedding': False}, 'encoder_wi': {'kernel': False},
           'encoder_wo': {'kernel': False}, 'decoder_wi': {'kernel': True},
           'decoder_wo': {'kernel': True}}
ENCODER = {k: {n: not v for n, v in d.items()} for k, d in DECODER.items()}


@pytest.mark.parametrize('name', ['sgd', 'adam', 'adamw', 'lion', 'adabelief', 'yogi',
                                  'adafactor_t5x', 'decoder_only'])
def test_small_model_trains_under_partitioner(name):  # F-O4 (adapted)
    model = Block()
    x = np.arange(8).reshape(2, 4) % 32
    opt_def = {
        'sgd': lambda: optimizers.sgd(0.1), 'adam': lambda: optimizers.adam(0.01),
        'adamw': lambda: optimizers.adamw(0.01), 'lion': lambda: optimizers.lion(0.001),
        'adabelief': lambda: optimizers.adabelief(0.01), 'yogi': lambda: optimizers.yogi(0.01),
        'adafactor_t5x': lambda: adafactor.Adafactor(
            0.01, logical_factor_rules=adafactor.standard_logical_factor_rules()),
        'decoder_only': lambda: optimizers.multi_transform(
            {'train': optim.adam(0.01), 'freeze': optim.set_to_zero()},
            # labels frozen like the params TrainStateInitializer freezes (optax needs the
            # same tree kind, flax#3050)
            freeze({k: {n: 'train' if v else 'freeze' for n, v in d.items()}
                    for k, d in DECODER.items()})),
    }[name]()
    p = partitioning.PjitPartitioner(num_partitions=2)

    def init_fn(rng, input_shapes, input_types=None):
        return model.init(rng, np.zeros(input_shapes['x'], np.int64))

    init = utils.TrainStateInitializer(opt_def, init_fn, {'x': (2, 4)}, p)
    axes = init.train_state_axes
    assert axes.params['decoder_wi']['kernel'] == P(None, 'model')
    state = init.from_scratch(random.PRNGKey(0))
    assert state.params['decoder_wi']['kernel'].sharding.spec == P(None, 'model')
    before = {k: np.asarray(v['kernel'] if 'kernel' in v else v['embedding'])
              for k, v in state.params.items()}

    def loss_fn(params, batch):
        logits = model.apply({'params': params}, batch)
        return cts.numpy.mean(cts.numpy.square(logits))

    def train_step(st, batch):
        loss, g = cts.value_and_grad(loss_fn)(st.params, batch)
        return st.apply_gradient(g, learning_rate=0.01), loss

    step = p.partition(train_step, (axes, p.data_partition_spec), (axes, None),
                       donate_argnums=(0,))
    losses = []
    for _ in range(2):
        state, loss = step(state, x)
        losses.append(float(np.asarray(loss)))
    assert int(state.step) == 2
    for leaf in cts.tree_util.tree_leaves(state.params):
        assert np.all(np.isfinite(np.asarray(leaf)))
    after = {k: np.asarray(v['kernel'] if 'kernel' in v else v['embedding'])
             for k, v in state.params.items()}
    changed = {k for k in after if not np.array_equal(after[k], before[k])}
    if name == 'decoder_only':
        assert changed == {'decoder_wi', 'decoder_wo'}
    else:
        assert changed == set(after)
    sd = state.state_dict()
    back = state.restore_state(sd)
    assert cts.tree_util.tree_structure(back) == cts.tree_util.tree_structure(state)


def test_optax_wrapper_reuses_the_kernel_plan_and_matches_a_rebuilt_one():
    # OptaxWrapper's fused step hands its kernel plan to the OptimizerState it returns, as
    # TrainState does; the next step reuses it while the buffers are the same. Reusing or
    # rebuilding it gives the same bits.
    rng = np.random.default_rng(5)
    params = {f"l{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate([3, 64, 7])}
    grads = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
             for _ in range(3)]
    runs = {}
    for reuse in (True, False):
        opt = optimizers.OptaxWrapper(optim.adamw(1e-2, weight_decay=0.1)).create(params)
        plans = []
        for g in grads:
            if not reuse:
                opt.state.__dict__.pop("_ct_plan", None)
            opt = opt.apply_gradient(cts.device_put(g))
            plans.append(opt.state.__dict__.get("_ct_plan"))
        if reuse:
            assert plans[0] is not None and plans[1] is plans[0] and plans[2] is plans[0]
        runs[reuse] = [np.asarray(x).tobytes() for x in
                       cts.tree_util.tree_leaves((opt.target, opt.state.param_states))]
    assert runs[True] == runs[False]


def test_apply_gradient_with_grads_unlike_the_params_names_the_param():
    """A missing or wrongly shaped grad used to surface as a KeyError or a numpy broadcasting
    error from deep inside the optimizer; now the param is named, before any update."""
    from ctrainstate.t5x import adafactor as t5x_adafactor
    from ctrainstate.t5x import optimizers as topt
    params = {"dense": {"kernel": np.ones((4, 4), np.float32), "bias": np.ones(4, np.float32)}}
    kernels = topt.ModelParamTraversal(lambda path, _: "kernel" in path)
    biases = topt.ModelParamTraversal(lambda path, _: "bias" in path)
    for opt_def in (topt.MultiOptimizer([(kernels, t5x_adafactor.Adafactor(0.1)),
                                         (biases, t5x_adafactor.Adafactor(0.2))]),
                    t5x_adafactor.Adafactor(0.1), topt.adam(0.1)):
        opt = opt_def.create(params)
        # (an OptaxWrapper's fused step checks the grads itself, naming the path its way)
        with pytest.raises(ValueError, match=r"grads have no entry for param 'dense/bias'|"
                                             r"first difference at \['dense'\]\['bias'\]"):
            opt.apply_gradient({"dense": {"kernel": np.ones((4, 4), np.float32)}})
        with pytest.raises(ValueError, match=r"grads\['dense/bias'\] has shape \(5,\), the "
                                             r"param \(4,\)|grads\['dense'\]\['bias'\] has "
                                             r"shape \(5,\)"):
            opt.apply_gradient({"dense": {"kernel": np.ones((4, 4), np.float32),
                                          "bias": np.ones(5, np.float32)}})
        with pytest.raises(ValueError, match=r"grads have an entry 'dense/extra'|"
                                             r"first difference at \['dense'\]\['extra'\]"):
            opt.apply_gradient({"dense": {"kernel": np.ones((4, 4), np.float32),
                                          "bias": np.ones(4, np.float32),
                                          "extra": np.ones(1, np.float32)}})
        np.testing.assert_array_equal(np.asarray(opt.target["dense"]["bias"]), 1.0)


# --- regression tests for parity bugs found in ctrainstate.t5x's optimizers (expectations from
# shared/reference/t5x_hf.md, section cited per test, and the upstream code it describes)

BF16 = _dtypes.bfloat16


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


class _PlainSGD(optimizers.OptimizerDef):
    """A per-param OptimizerDef without derive_logical_axes (a user's own, or flax.optim's)."""

    def __init__(self, lr):
        super().__init__(_t5x_optimizers._OptaxHyperParams(lr))

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
