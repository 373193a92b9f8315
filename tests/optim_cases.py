"""Parity cases shared by tests/optim/test_optim_parity.py and tests/data/gen_optax_vectors.py.

Each case builds its optimizer from a module with optax's API (``optax`` or
``ctrainstate.optim``), so the same line describes both sides. Grads are
drawn from numpy's PCG64 with a fixed seed, identical on both sides.
"""
import numpy as np

STEPS = 100
SHAPES = {"a": (8, 16), "b": (16,), "c": {"d": (4, 8, 2), "e": (8,)}}


def _map(f, t, path=()):
    if isinstance(t, dict):
        return {k: _map(f, v, path + (k,)) for k, v in t.items()}
    return f(path, t)


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    return _map(lambda p, s: rng.standard_normal(s).astype(np.float32), SHAPES)


def grads_for(step, scale=1.0, nan_steps=()):
    rng = np.random.default_rng(1000 + step)
    g = _map(lambda p, s: (scale * rng.standard_normal(s)).astype(np.float32), SHAPES)
    if step in nan_steps:
        g["b"][3] = np.nan
    return g


def flat(tree):
    out = []
    for k in sorted(tree):
        v = tree[k]
        out.append(flat(v) if isinstance(v, dict) else np.asarray(v, np.float32).ravel())
    return np.concatenate(out)


def _ndim_gt1(params):
    return _map(lambda p, x: np.ndim(x) > 1, params)


def _rank_labels(params):
    return _map(lambda p, x: "matrix" if np.ndim(x) > 1 else "vector", params)


# name -> (make(lib) -> tx, grads kwargs)
CASES = {
    "sgd": (lambda o: o.sgd(0.1), {}),
    "sgd_momentum": (lambda o: o.sgd(0.05, momentum=0.9), {}),
    "sgd_nesterov": (lambda o: o.sgd(0.05, momentum=0.9, nesterov=True), {}),
    "adam": (lambda o: o.adam(1e-2), {}),
    "adam_nesterov_eps_root": (lambda o: o.adam(1e-2, eps_root=1e-8, nesterov=True), {}),
    "adamw": (lambda o: o.adamw(1e-2, weight_decay=0.1), {}),
    "adamw_mask": (lambda o: o.adamw(1e-2, weight_decay=0.1, mask=_ndim_gt1), {}),
    "adamw_wd_schedule": (lambda o: o.adamw(1e-2, weight_decay=o.linear_schedule(0.1, 0.0, 50)), {}),
    "adafactor": (lambda o: o.adafactor(1e-2, min_dim_size_to_factor=4), {}),
    "adafactor_momentum_wd": (lambda o: o.adafactor(1e-2, min_dim_size_to_factor=4, momentum=0.9,
                                                    weight_decay_rate=0.01), {}),
    "lamb": (lambda o: o.lamb(1e-2, weight_decay=0.01), {}),
    "lion": (lambda o: o.lion(1e-3, weight_decay=0.1), {}),
    "rmsprop": (lambda o: o.rmsprop(1e-2), {}),
    "rmsprop_centered": (lambda o: o.rmsprop(1e-2, centered=True, initial_scale=0.1), {}),
    "rmsprop_centered_bc_momentum": (lambda o: o.rmsprop(1e-3, centered=True, eps_in_sqrt=False,
                                                         bias_correction=True, momentum=0.9,
                                                         initial_scale=0.5), {}),
    "adamax": (lambda o: o.adamax(1e-2), {}),
    "amsgrad": (lambda o: o.amsgrad(1e-2), {}),
    "amsgrad_no_bc_eps_root": (lambda o: o.amsgrad(1e-2, b2=0.99, eps_root=1e-8,
                                                   bias_correction_nu=False), {}),
    "adamax_eps_nan": (lambda o: o.apply_if_finite(o.adamax(1e-2, b2=0.99, eps=1e-3), 3),
                       {"nan_steps": (5, 6)}),
    "adabelief": (lambda o: o.adabelief(1e-2), {}),
    "adabelief_nesterov_eps": (lambda o: o.adabelief(1e-2, eps=1e-8, eps_root=1e-10,
                                                     nesterov=True), {}),
    "yogi": (lambda o: o.yogi(1e-2), {}),
    "yogi_transform": (lambda o: o.chain(o.scale_by_yogi(b1=0.8, eps_root=1e-8,
                                                         initial_accumulator_value=0.1),
                                         o.scale(-0.01)), {}),
    # rho_t crosses the threshold at step 6 (5.0 default): both branches run
    "radam": (lambda o: o.radam(1e-2), {}),
    "radam_nesterov_threshold": (lambda o: o.radam(1e-2, b2=0.99, threshold=10.0,
                                                   nesterov=True), {}),
    # noise drawn per leaf in its sharding, equal to jax.random's bits
    "noisy_sgd": (lambda o: o.noisy_sgd(1e-2, eta=0.1, key=7), {}),
    "noisy_sgd_momentum": (lambda o: o.chain(o.add_noise(0.05, 0.3, 11), o.sgd(1e-2, 0.9)), {}),
    "inject_adamw_schedule": (lambda o: o.inject_hyperparams(o.adamw)(
        learning_rate=o.cosine_decay_schedule(1e-2, 80), weight_decay=0.05), {}),
    "inject_static_sgd": (lambda o: o.chain(o.clip_by_global_norm(3.0), o.inject_hyperparams(
        o.sgd, static_args=("momentum",))(learning_rate=0.05, momentum=0.9, nesterov=True)), {}),
    "multisteps_adamw_k3": (lambda o: o.MultiSteps(o.adamw(1e-2, weight_decay=0.1),
                                                   3).gradient_transformation(), {}),
    "multisteps_sum_k_schedule": (lambda o: o.MultiSteps(
        o.chain(o.clip_by_global_norm(2.0), o.sgd(0.05, momentum=0.9)), lambda s: 1 + s % 3,
        use_grad_mean=False).gradient_transformation(), {}),
    # mini-steps with a NaN are dropped (not accumulated); unfused path
    "multisteps_skip_not_finite": (lambda o: o.MultiSteps(
        o.adam(1e-2), 2, should_skip_update_fn=o.skip_not_finite).gradient_transformation(),
        {"nan_steps": (3, 10, 11)}),
    "fromage": (lambda o: o.fromage(1e-2), {}),
    "fromage_schedule": (lambda o: o.fromage(o.linear_schedule(1e-2, 1e-3, 80)), {}),
    "lars": (lambda o: o.lars(1e-1, weight_decay=1e-3), {}),
    "lars_masks_nesterov": (lambda o: o.lars(1e-1, weight_decay=1e-3,
                                             weight_decay_mask=_ndim_gt1,
                                             trust_ratio_mask=_ndim_gt1, nesterov=True), {}),
    "rmsprop_momentum_bc": (lambda o: o.rmsprop(1e-2, momentum=0.9, bias_correction=True,
                                                eps_in_sqrt=False, initial_scale=0.1), {}),
    "adagrad": (lambda o: o.adagrad(0.1), {}),
    "clip_by_global_norm_adam": (lambda o: o.chain(o.clip_by_global_norm(4.0), o.adam(1e-2)),
                                 {"scale": 1.0}),
    "clip_sgd": (lambda o: o.chain(o.clip(0.5), o.sgd(0.1)), {}),
    "add_decayed_weights_mask_scale": (lambda o: o.chain(
        o.add_decayed_weights(0.01, mask=_ndim_gt1), o.scale(-0.1)), {}),
    "masked_adam": (lambda o: o.chain(o.masked(o.adam(1e-2), _ndim_gt1), o.scale(0.5)), {}),
    # a mask that is a prefix of the params tree: {'c': True} covers the whole subtree
    "masked_prefix_adam": (lambda o: o.chain(o.masked(o.adam(1e-2), {"a": True, "b": False,
                                                                   "c": True}), o.scale(0.5)), {}),
    # params['b'] frozen: its NaN grads must not reach it (set_to_zero gives +0, not NaN * 0)
    "freeze_prefix_adam": (lambda o: o.chain(o.freeze({"a": False, "b": True, "c": False}),
                                             o.adam(1e-2)), {"nan_steps": (4, 9)}),
    "partition_labels_fn": (lambda o: o.partition(
        {"matrix": o.adamw(1e-2, weight_decay=0.1), "vector": o.sgd(0.05, momentum=0.9)},
        _rank_labels), {}),
    "multi_transform_prefix_frozen": (lambda o: o.multi_transform(
        {"x": o.lion(1e-3), "frozen": o.set_to_zero(), "y": o.chain(o.clip(0.5), o.adam(1e-2))},
        {"a": "x", "b": "frozen", "c": "y"}), {"nan_steps": (2, 7)}),
    "apply_if_finite_adam": (lambda o: o.apply_if_finite(o.adam(1e-2), 2),
                             {"nan_steps": (3, 10, 11, 20, 21)}),
    # the third non-finite step in a row is applied anyway (NaN reaches params['b'][3])
    "apply_if_finite_forced": (lambda o: o.apply_if_finite(o.sgd(0.1, momentum=0.5), 1),
                               {"nan_steps": (5, 30, 31)}),
    "scale_by_schedule": (lambda o: o.chain(o.scale_by_adam(), o.scale_by_schedule(
        lambda c: -0.01 * (0.99 ** c))), {}),
    "lr_constant": (lambda o: o.sgd(o.constant_schedule(0.05)), {}),
    "lr_linear": (lambda o: o.sgd(o.linear_schedule(0.1, 0.01, 60, 10)), {}),
    "lr_cosine": (lambda o: o.adam(o.cosine_decay_schedule(1e-2, 80, alpha=0.1)), {}),
    "lr_warmup_cosine": (lambda o: o.adamw(o.warmup_cosine_decay_schedule(0.0, 1e-2, 10, 90, 1e-4)), {}),
    "lr_exponential": (lambda o: o.sgd(o.exponential_decay(0.1, 10, 0.8, transition_begin=5,
                                                           staircase=True, end_value=0.02)), {}),
    "lr_join": (lambda o: o.sgd(o.join_schedules([o.constant_schedule(0.1),
                                                   o.linear_schedule(0.1, 0.0, 50)], [30])), {}),
    "lr_piecewise": (lambda o: o.sgd(o.piecewise_constant_schedule(0.1, {20: 0.5, 60: 0.1})), {}),
}

SCHEDULES = {
    "constant": lambda o: o.constant_schedule(0.3),
    "linear": lambda o: o.linear_schedule(1.0, 0.1, 50, 7),
    "cosine": lambda o: o.cosine_decay_schedule(2.0, 60, alpha=0.05, exponent=2.0),
    "warmup_cosine": lambda o: o.warmup_cosine_decay_schedule(0.0, 1.0, 10, 100, 0.01),
    "exponential": lambda o: o.exponential_decay(1.0, 7, 0.5, transition_begin=3),
    "exponential_staircase": lambda o: o.exponential_decay(1.0, 7, 0.5, staircase=True, end_value=0.1),
    "join": lambda o: o.join_schedules([o.constant_schedule(1.0), o.linear_schedule(1.0, 0.0, 20)], [15]),
    "piecewise": lambda o: o.piecewise_constant_schedule(1.0, {10: 0.5, 40: 0.2, 80: 3.0}),
}


def run_optax(name):
    """Final params after STEPS steps with optax (jax on CPU)."""
    import jax
    import jax.numpy as jnp
    import optax
    make, gk = CASES[name]
    tx = make(optax)
    params = jax.tree.map(jnp.asarray, init_params())
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for i in range(STEPS):
        params, state = step(params, state, jax.tree.map(jnp.asarray, grads_for(i, **gk)))
    return flat(jax.tree.map(np.asarray, params))
