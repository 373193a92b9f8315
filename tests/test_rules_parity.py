"""Parity with Flax: random rule tables and logical specs resolved by ctrainstate and by
flax.linen (results, error types and error messages). Skips without jax/flax."""
import random

import pytest

flax_spmd = pytest.importorskip('flax.linen.spmd')
jax_sharding = pytest.importorskip('jax.sharding')

from ctrainstate import nn  # noqa: E402
from ctrainstate.nn import spmd  # noqa: E402
from ctrainstate.sharding import PartitionSpec as P  # noqa: E402

pytestmark = pytest.mark.parity

JP = jax_sharding.PartitionSpec
LOGICAL = ['a', 'b', 'c', 'd', 'e']
MESH = ['x', 'y', 'z']


class _Unc:
    """Marker for UNCONSTRAINED, translated to each library's singleton."""


UNC = _Unc()


def _mesh_value(rng):
    k = rng.random()
    if k < 0.2:
        return None
    if k < 0.3:
        return UNC
    if k < 0.65:
        return rng.choice(MESH)
    return tuple(rng.sample(MESH, rng.randint(1, 3)))


def _name(rng):
    k = rng.random()
    if k < 0.1:
        return None
    if k < 0.15:
        return UNC
    if k < 0.2:
        return tuple(rng.sample(MESH, 2))
    return rng.choice(LOGICAL)


def _to(lib_unc, obj):
    if obj is UNC:
        return lib_unc
    if isinstance(obj, tuple):
        return tuple(_to(lib_unc, o) for o in obj)
    return obj


def _norm(result, lib_unc, unassigned):
    """Library-independent form of a raw resolution result."""
    def one(e):
        if e is unassigned:
            return '<unassigned>'
        if e is lib_unc:
            return '<UNC>'
        return e
    return None if result is None else [one(e) for e in result]


def _squash(spec):
    """Recent jax PartitionSpecs store a 1-tuple entry ('y',) as 'y'; compare modulo that."""
    return [e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in spec]


def _run(fn):
    try:
        return ('ok', fn())
    except Exception as e:   # compare type and message
        return ('err', type(e).__name__, str(e))


def _cases(seed, n):
    rng = random.Random(seed)
    for _ in range(n):
        rules = tuple((rng.choice(LOGICAL + [None]) if rng.random() < 0.95 else None, _mesh_value(rng))
                      for _ in range(rng.randint(0, 8)))
        names = tuple(_name(rng) for _ in range(rng.randint(0, 5)))
        yield names, rules


@pytest.mark.parametrize('seed', [0, 1])
def test_random_tables_match_flax(seed):
    mismatches = []
    for names, rules in _cases(seed, 2500):
        f_names, f_rules = _to(JP.UNCONSTRAINED, names), _to(JP.UNCONSTRAINED, rules)
        c_names, c_rules = _to(P.UNCONSTRAINED, names), _to(P.UNCONSTRAINED, rules)
        want = _run(lambda: _norm(flax_spmd._logical_to_mesh_axes(f_names, f_rules),
                                  JP.UNCONSTRAINED, flax_spmd._unassigned_axis))
        got = _run(lambda: _norm(spmd._logical_to_mesh_axes(c_names, c_rules),
                                 P.UNCONSTRAINED, spmd._unassigned_axis))
        if want != got:
            mismatches.append((names, rules, want, got))
    assert mismatches == [], mismatches[:5]


def test_public_results_match_flax():
    for names, rules in _cases(7, 500):
        f = _run(lambda: flax_spmd.logical_to_mesh_axes(_to(JP.UNCONSTRAINED, names),
                                                        _to(JP.UNCONSTRAINED, rules)))
        c = _run(lambda: nn.logical_to_mesh_axes(_to(P.UNCONSTRAINED, names),
                                                 _to(P.UNCONSTRAINED, rules)))
        if f[0] == 'err':
            assert c[0] == 'err' and c[1:] == f[1:]
        else:
            assert c[0] == 'ok'
            assert _squash(_norm(c[1], P.UNCONSTRAINED, None)) == _squash(
                _norm(tuple(f[1]), JP.UNCONSTRAINED, None))


@pytest.mark.parametrize('rules', [{'a': 'x'}, None, 'ab', (('a', 'x', 'y'),)])
def test_bad_rules_objects_match_flax(rules):
    f = _run(lambda: flax_spmd.logical_to_mesh_axes(('a', 'b'), rules if rules is not None else ()))
    c = _run(lambda: nn.logical_to_mesh_axes(('a', 'b'), rules if rules is not None else ()))
    assert f[0] == c[0] and (f[0] == 'ok' or f[1] == c[1])
