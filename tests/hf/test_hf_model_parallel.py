"""HF ports: run_clm_mp optimizer-state specs (F-H4), the dropout-rng TrainState and pmap
helpers (F-F2, F-F3), sharded init of (params, opt_state), block-wise bf16 casts."""
import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import P, hf, optim, random
from ctrainstate.hf.partitions import gpt_neo_rules, set_partitions
from ctrainstate.optim import ScaleByAdamState, ScaleByScheduleState

N = cts.local_device_count()


def gpt_neo_params(vocab=64, pos=16, d=8, layers=2):
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    h = {}
    for i in range(layers):
        h[str(i)] = {
            'ln_1': {'scale': z(d), 'bias': z(d)}, 'ln_2': {'scale': z(d), 'bias': z(d)},
            'attn': {'attention': {'q_proj': {'kernel': z(d, d)}, 'k_proj': {'kernel': z(d, d)},
                                   'v_proj': {'kernel': z(d, d)},
                                   'out_proj': {'kernel': z(d, d), 'bias': z(d)}}},
            'mlp': {'c_fc': {'kernel': z(d, 4 * d), 'bias': z(4 * d)},
                    'c_proj': {'kernel': z(4 * d, d), 'bias': z(d)}}}
    return {'transformer': {'wte': {'embedding': z(vocab, d)}, 'wpe': {'embedding': z(pos, d)},
                            'h': h, 'ln_f': {'scale': z(d), 'bias': z(d)}}}


def schedule():
    return optim.join_schedules([optim.linear_schedule(0.0, 1e-3, 2),
                                 optim.linear_schedule(1e-3, 0.0, 8)], [2])


@pytest.mark.parametrize('abstract', [False, True])
def test_run_clm_mp_opt_state_spec(abstract):  # F-H4
    params = gpt_neo_params()
    spec = set_partitions(params, gpt_neo_rules())
    tx = optim.adamw(schedule(), b1=0.9, b2=0.98, eps=1e-8, weight_decay=0.01)
    state = cts.eval_shape(tx.init, params) if abstract else tx.init(params)
    got = hf.opt_state_spec(state, params, spec)
    assert got == (ScaleByAdamState(count=None, mu=spec, nu=spec), None,
                   ScaleByScheduleState(count=None))
    # constant learning rate: the third element is an EmptyState, which also becomes None
    tx2 = optim.adamw(1e-3)
    assert hf.opt_state_spec(tx2.init(params), params, spec)[1:] == (None, None)


def test_run_clm_mp_sharded_init_and_step():
    """run_clm_mp's get_initial_state under pjit with ('dp','mp') mesh: params and opt state
    born in the param specs; a step keeps them there."""
    params = gpt_neo_params()
    spec = set_partitions(params, gpt_neo_rules())
    tx = optim.adamw(schedule(), weight_decay=0.01)
    opt_spec = hf.opt_state_spec(cts.eval_shape(tx.init, params), params, spec)

    def get_initial_state(p):
        return tx.init(p), p

    mesh = cts.Mesh(np.array(cts.devices()).reshape(1, N), ('dp', 'mp'))
    with mesh:
        p_init = cts.pjit(get_initial_state, in_axis_resources=(spec,),
                          out_axis_resources=(opt_spec, spec))
        opt_state, p = p_init(params)
        k = p['transformer']['h']['0']['mlp']['c_fc']['kernel']
        mu = opt_state[0].mu['transformer']['h']['0']['mlp']['c_fc']['kernel']
        assert k.sharding.spec == P(None, 'mp') and mu.sharding == k.sharding
        # no device holds more than its block of the sharded moments
        assert all(s.data.shape == (8, 32 // N) for s in mu.addressable_shards)
        grads = cts.tree_util.tree_map(lambda x: np.ones(x.shape, np.float32), params)

        def train_step(p, o, g):
            updates, o = tx.update(g, o, p)
            return optim.apply_updates(p, updates), o

        p_step = cts.pjit(train_step, in_axis_resources=(spec, opt_spec, None),
                          out_axis_resources=(spec, opt_spec))
        p2, o2 = p_step(p, opt_state, grads)
    assert int(o2[2].count) == 1
    # first step of the schedule has lr 0: params unchanged; second step moves them
    np.testing.assert_array_equal(np.asarray(p2['transformer']['wte']['embedding']), 0)
    assert p2['transformer']['wte']['embedding'].sharding.spec == P('mp', None)


def test_train_state_with_dropout_rng():  # F-F2
    rng, dropout_rng = random.split(random.PRNGKey(0))
    s = hf.TrainState.create(apply_fn=None, params={'w': np.ones(4, np.float32)},
                             tx=optim.sgd(0.5), dropout_rng=dropout_rng)
    assert s.step == 0
    new_rng = random.split(dropout_rng)[0]
    s2 = s.apply_gradients(grads={'w': np.ones(4, np.float32)}, dropout_rng=new_rng)
    assert s2.step == 1 and np.array_equal(s2.dropout_rng, new_rng)
    np.testing.assert_allclose(np.asarray(s2.params['w']), 0.5)


def test_replicate_shard_unreplicate():  # F-F3
    rng = random.PRNGKey(42)
    s = hf.TrainState.create(apply_fn=None, params={'w': np.arange(6, dtype=np.float32)},
                             tx=optim.adam(1e-3), dropout_rng=rng)
    r = s.replicate()
    for leaf in cts.tree_util.tree_leaves(r):
        assert np.shape(leaf)[0] == N
    assert r.dropout_rng.shape == (N, 2)
    np.testing.assert_array_equal(np.asarray(r.dropout_rng), random.split(rng, N))
    assert len({tuple(k) for k in np.asarray(r.dropout_rng)}) == N  # one key per device
    w = r.params['w']
    assert all(s_.data.shape == (1, 6) for s_ in w.addressable_shards)  # one copy per device
    u = hf.unreplicate(r.params)
    np.testing.assert_array_equal(np.asarray(u['w']), np.arange(6))
    batch = {'input_ids': np.arange(N * 3 * 5).reshape(N * 3, 5)}
    sb = hf.shard(batch)
    assert sb['input_ids'].shape == (N, 3, 5)
    np.testing.assert_array_equal(sb['input_ids'][1, 0], batch['input_ids'][3])


def test_bf16_cast_keeps_shards(mem_baseline):
    mesh = cts.Mesh(np.array(cts.devices()).reshape(2, N // 2), ('data', 'model'))
    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 7
    a = cts.device_put(x, cts.NamedSharding(mesh, P('data', 'model')))
    b = hf.to_bf16({'k': a, 'i': np.arange(3, dtype=np.int32)})
    assert str(b['k'].dtype) == 'bfloat16' and b['k'].sharding == a.sharding
    assert b['i'].dtype == np.int32
    np.testing.assert_array_equal(np.asarray(b['k']).astype(np.float32),
                                  x.astype(cts._src.base.dtypes.bfloat16).astype(np.float32))
    for sa, sb in zip(a.addressable_shards, b['k'].addressable_shards):
        assert sa.device == sb.device and sa.index == sb.index
        assert sb.data.nbytes == sa.data.nbytes // 2
    back = hf.to_fp32(b)['k']
    assert back.dtype == np.float32 and back.sharding == a.sharding


def test_unreplicate_is_row_zero_for_any_sharding():
    """flax's unreplicate is x[0]; for an array also sharded beyond dim 0 it returned part
    of the row (the first shard's)."""
    from ctrainstate.hf.train_state import unreplicate
    x = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    for spec in (cts.P("data", "model"), cts.P(None, "model"), cts.P("data"), cts.P(),
                 cts.P(("data", "model"))):
        r = unreplicate({"w": cts.device_put(x, cts.NamedSharding(mesh, spec))})["w"]
        np.testing.assert_array_equal(np.asarray(r), x[0], err_msg=str(spec))
    np.testing.assert_array_equal(unreplicate(x), x[0])
