"""Parity with Flax: random rule tables and logical specs resolved by ctrainstate and by
flax.linen (results, error types and error messages). Flax's side is recorded
(tests/data/recorded, as JSON) and compared live in each test's twin marked `parity`
(`jax_ref`)."""
import importlib
import json
import random

import pytest

from ctrainstate import nn
from ctrainstate._src.nn import spmd
from ctrainstate.sharding import PartitionSpec as P

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


def _json(x):
    """x as recorded (through JSON: tuples read back as lists)."""
    return json.loads(json.dumps(x))


def _flax(jax):
    return importlib.import_module('flax.linen.spmd'), jax.sharding.PartitionSpec


def _flax_tables(jax, seed):
    flax_spmd, JP = _flax(jax)
    out = []
    for names, rules in _cases(seed, 2500):
        f_names, f_rules = _to(JP.UNCONSTRAINED, names), _to(JP.UNCONSTRAINED, rules)
        out.append(_run(lambda: _norm(flax_spmd._logical_to_mesh_axes(f_names, f_rules),
                                      JP.UNCONSTRAINED, flax_spmd._unassigned_axis)))
    return json.dumps(out)


@pytest.mark.parametrize('seed', [0, 1])
def test_random_tables_match_flax(seed, jax_ref):
    wants = json.loads(jax_ref('results', lambda jax: _flax_tables(jax, seed)))
    mismatches = []
    for (names, rules), want in zip(_cases(seed, 2500), wants, strict=True):
        c_names, c_rules = _to(P.UNCONSTRAINED, names), _to(P.UNCONSTRAINED, rules)
        got = _json(_run(lambda: _norm(spmd._logical_to_mesh_axes(c_names, c_rules),
                                       P.UNCONSTRAINED, spmd._unassigned_axis)))
        if want != got:
            mismatches.append((names, rules, want, got))
    assert mismatches == [], mismatches[:5]


def _flax_public(jax):
    flax_spmd, JP = _flax(jax)
    out = []
    for names, rules in _cases(7, 500):
        f = _run(lambda: flax_spmd.logical_to_mesh_axes(_to(JP.UNCONSTRAINED, names),
                                                        _to(JP.UNCONSTRAINED, rules)))
        out.append(f if f[0] == 'err' else ('ok', _squash(_norm(tuple(f[1]), JP.UNCONSTRAINED,
                                                                None))))
    return json.dumps(out)


def test_public_results_match_flax(jax_ref):
    wants = json.loads(jax_ref('results', _flax_public))
    for (names, rules), f in zip(_cases(7, 500), wants, strict=True):
        c = _run(lambda: nn.logical_to_mesh_axes(_to(P.UNCONSTRAINED, names),
                                                 _to(P.UNCONSTRAINED, rules)))
        if f[0] == 'err':
            assert c[0] == 'err' and list(c[1:]) == f[1:]
        else:
            assert c[0] == 'ok'
            assert _json(_squash(_norm(c[1], P.UNCONSTRAINED, None))) == f[1]


@pytest.mark.parametrize('rules', [{'a': 'x'}, None, 'ab', (('a', 'x', 'y'),)])
def test_bad_rules_objects_match_flax(rules, jax_ref):
    def flax_side(jax):   # 'ok', or 'err' and the exception's type
        r = _run(lambda: _flax(jax)[0].logical_to_mesh_axes(('a', 'b'), rules if rules is not None
                                                            else ()))
        return json.dumps(r[:1] if r[0] == 'ok' else r[:2])

    f = json.loads(jax_ref('result', flax_side))
    c = _run(lambda: nn.logical_to_mesh_axes(('a', 'b'), rules if rules is not None else ()))
    assert f[0] == c[0] and (f[0] == 'ok' or f[1] == c[1])
