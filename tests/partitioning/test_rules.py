"""Rules context (C1-C4) and logical_to_mesh_axes resolution (L1-L20, D1-D15, t5x tables).

Expected values are the upstream facts of shared/reference/flax_partitioning.md
(§3.1, §3.2, Flax 0.12.3+ column) and the t5x tables of shared/reference/t5x_hf.md (§2.1, §2.2).
"""
import threading

import pytest

from ctrainstate import nn
from ctrainstate import partitioning as nn_partitioning
from ctrainstate.sharding import PartitionSpec as P

UNC = P.UNCONSTRAINED
R1 = (('foo', 'data'), ('bar', 'model'), ('baz', None))
R2 = (('foo', 'model'), ('bar', None), ('baz', 'data'))
T5X_STYLE = (('batch', 'data'), ('vocab', 'model'), ('mlp', 'model'), ('heads', 'model'),
             ('joined_kv', None), ('kv', None), ('embed', 'model'), ('embed', 'data'),
             ('relpos_buckets', None), ('length', None), ('layers', None), ('stack', None))
L5_RULES = (('foo', 'model'), ('bar', 'model'), ('baz', 'data'))


@pytest.fixture(autouse=True)
def _clean_rules():
    nn_partitioning.set_axis_rules(())
    yield
    nn_partitioning.set_axis_rules(())


# --- rules context -------------------------------------------------------------------

def test_c1_default_is_empty_tuple():
    out = []
    t = threading.Thread(target=lambda: out.append(nn_partitioning.get_axis_rules()))
    t.start(); t.join()
    assert out == [()]
    assert nn.get_logical_axis_rules() == ()


def test_c2_set_and_get_same_object():
    nn_partitioning.set_axis_rules(R1)
    assert nn_partitioning.get_axis_rules() is R1
    assert nn.get_logical_axis_rules() is R1


def test_c3_nesting_replaces_and_restores():
    nn_partitioning.set_axis_rules(R1)
    with nn_partitioning.axis_rules(R2) as bound:
        assert bound is None
        assert nn_partitioning.get_axis_rules() is R2
        assert nn_partitioning.logical_to_mesh_axes(('foo', 'bar')) == ('model', None)   # L3
    assert nn_partitioning.get_axis_rules() is R1


def test_c4_set_empty():
    nn_partitioning.set_axis_rules(R1)
    nn_partitioning.set_axis_rules(())
    assert nn_partitioning.get_axis_rules() == ()


def test_context_restored_on_exception():
    nn_partitioning.set_axis_rules(R1)
    with pytest.raises(KeyError):
        with nn.logical_axis_rules(R2):
            raise KeyError('boom')
    assert nn_partitioning.get_axis_rules() is R1


def test_set_stores_anything_and_fails_later():
    nn_partitioning.set_axis_rules({'a': 'x'})
    assert nn_partitioning.get_axis_rules() == {'a': 'x'}
    with pytest.raises(ValueError, match='Unknown axis rule specification type.'):
        nn_partitioning.logical_to_mesh_axes(('a',))


def test_same_context_object_reentered():
    ctx = nn.logical_axis_rules(R2)
    with ctx:
        with nn.logical_axis_rules(R1):
            with ctx:
                assert nn.get_logical_axis_rules() is R2
            assert nn.get_logical_axis_rules() is R1
        assert nn.get_logical_axis_rules() is R2
    assert nn.get_logical_axis_rules() == ()


# --- resolution ----------------------------------------------------------------------

RESOLUTION = [
    ('L1', ('foo', 'bar'), R1, ('data', 'model')),
    ('L5', ('foo', 'bar', 'baz'), L5_RULES, ('model', None, 'data')),
    ('L6', ('bar', 'foo', 'baz'), L5_RULES, (None, 'model', 'data')),
    ('L7', ('baz', 'bar', 'foo'), L5_RULES, ('data', None, 'model')),
    ('L8', ('baz', 'bar', 'foo', 'unassigned'), L5_RULES, ('data', None, 'model', None)),
    ('L9', ('a', 'b'), (('a', ('model', 'data')), ('b', 'data')), (('model', 'data'), None)),
    ('L10', ('a', 'b'), (('a', ('model', 'replica')), ('b', 'data')), (('model', 'replica'), 'data')),
    ('L11', ('a', 'b'), (('a', ('model', 'replica')), ('b', ('data', 'model'))),
     (('model', 'replica'), None)),
    ('L12', ('a', 'b', 'c'), (('a', ('model', 'replica')), ('b', 'model')),
     (('model', 'replica'), None, None)),
    ('L13', ('a', 'b', 'c'), (), (None, None, None)),
    ('L14', ('a', 'b'), (('a', None), ('a', 'model')), (None, None)),
    ('L15', ('baz', 'bar', 'foo'), (('baz', 'data'), ('bar', None), ('foo', 'model'), ('foo', 'data')),
     ('data', None, 'model')),
    ('L16', ('baz', UNC, 'foo'), (('baz', 'data'), ('foo', ('model', 'emb'))),
     ('data', UNC, ('model', 'emb'))),
    ('L17', ('foo', UNC, UNC, None, None), R1, ('data', UNC, UNC, None, None)),
    ('L18', ('foo', 'bad', 'bar', 'baz'), (('foo', None), ('bad', None), ('bar', UNC), ('baz', UNC)),
     (None, None, UNC, UNC)),
    ('L19', ('batch', 'length', 'heads', 'features'),
     (('batch', 'X'), ('features', 'X'), ('heads', 'Y'), ('batch', 'Z')), ('X', None, 'Y', None)),
    ('L20', ('batch', 'length', 'embed'), T5X_STYLE, ('data', None, 'model')),
    ('D1', ('embed', 'mlp'), T5X_STYLE, ('data', 'model')),
    ('D2', ('mlp', 'embed'), T5X_STYLE, ('model', 'data')),
    ('D3', ('batch', 'length', 'heads', 'kv'), T5X_STYLE, ('data', None, 'model', None)),
    ('D4', (None, 'foo'), R1, (None, 'data')),
    ('D5', (), R1, ()),
    ('D7', ('a', 'b'), (('a', 'model'), ('b', ('model', 'data'))), ('model', None)),
    ('D8', ('foo', 'bar'), (('bar', 'data'), ('foo', 'data')), (None, 'data')),
    ('D9', ('foo',), (('foo', ('data', 'model')),), (('data', 'model'),)),
    ('D10', (None, None, 'foo'), R1, (None, None, 'data')),
    ('D14', (None, 'x'), ((None, 'data'), ('x', 'model')), (None, 'model')),
    ('D15', (('p', 'q'), 'foo'), R1, (('p', 'q'), 'data')),
]


@pytest.mark.parametrize('case,names,rules,expected', RESOLUTION, ids=[c[0] for c in RESOLUTION])
def test_resolution_explicit_rules(case, names, rules, expected):
    got = nn_partitioning.logical_to_mesh_axes(names, rules)
    assert isinstance(got, P)
    assert got == P(*expected)
    assert tuple(got) == tuple(expected)   # 2022-2024 tests compare with plain tuples


@pytest.mark.parametrize('case,names,rules,expected', RESOLUTION, ids=[c[0] for c in RESOLUTION])
def test_resolution_context_rules(case, names, rules, expected):
    with nn_partitioning.axis_rules(rules):
        assert nn_partitioning.logical_to_mesh_axes(names) == P(*expected)   # L2 form
        assert nn.logical_to_mesh_axes(names) == P(*expected)


def test_result_keeps_rule_value_object():
    value = ('model', 'replica')
    got = nn.logical_to_mesh_axes(('a',), (('a', value),))
    assert got[0] == value


DUP = "Unsupported: Dimensions ('foo',) occur more than once in array names."


def test_l4_duplicate_names_context():
    with nn_partitioning.axis_rules(R1):
        with pytest.raises(ValueError) as e:
            nn_partitioning.logical_to_mesh_axes(('foo', 'foo', 'baz'))
    assert str(e.value) == DUP


def test_duplicates_listed_in_first_seen_order():
    with pytest.raises(ValueError) as e:
        nn.logical_to_mesh_axes(('b', 'a', 'b', 'a', 'c'), R1)
    assert str(e.value) == "Unsupported: Dimensions ('b', 'a') occur more than once in array names."


def test_d6_none_names():
    assert nn.logical_to_mesh_axes(None, R1) is None
    assert nn.logical_to_mesh_axes(None, {'bad': 'rules'}) is None


def test_d11_dict_rules():
    with pytest.raises(ValueError) as e:
        nn.logical_to_mesh_axes(('a',), {'a': 'x'})
    assert str(e.value) == 'Unknown axis rule specification type.'


def test_d12_rules_never_set():
    out = []
    t = threading.Thread(target=lambda: out.append(nn.logical_to_mesh_axes(('a',))))
    t.start(); t.join()
    assert out == [P(None)]


def test_d13_duplicate_check_precedes_rules_type_check():
    with pytest.raises(ValueError) as e:
        nn.logical_to_mesh_axes(('foo', 'foo'), {'a': 'x'})
    assert str(e.value) == DUP


def test_explicit_empty_rules_not_replaced_by_context():
    with nn.logical_axis_rules(R1):
        assert nn.logical_to_mesh_axes(('foo',), ()) == P(None)


def test_malformed_rule_names_the_rule():
    with pytest.raises(ValueError, match=r"axis rule 1 \(\('b', 'x', 'y'\)\)"):
        nn.logical_to_mesh_axes(('a',), (('a', 'x'), ('b', 'x', 'y')))
    with pytest.raises(TypeError, match='axis rule 0'):
        nn.logical_to_mesh_axes(('a',), (5,))


def test_unhashable_name_entry_raises_type_error():
    with pytest.raises(TypeError):
        nn.logical_to_mesh_axes((['a'], 'b'), R1)


# --- t5x standard_logical_axis_rules (t5x_hf.md §2.1) and their resolutions (§2.2) ------

_REPLICATED_TAIL = [('relpos_buckets', None), ('abspos_buckets', None), ('length', None),
                    ('layers', None), ('stack', None), ('mlp_activations', None)]
T5X_TABLES = {
    (1, 1): [('batch', 'data'), ('vocab', 'model'), ('embed', None), ('mlp', 'model'),
             ('heads', 'model'), ('kv', None), ('joined_kv', 'model')] + _REPLICATED_TAIL,
    (2, 1): [('batch', 'data'), ('vocab', 'model'), ('mlp', 'model'), ('heads', 'model'),
             ('kv', None), ('joined_kv', 'model'), ('embed', 'model')] + _REPLICATED_TAIL,
    (1, 2): [('batch', 'data'), ('vocab', 'model'), ('mlp', 'model'), ('heads', 'model'),
             ('kv', None), ('joined_kv', 'model'), ('embed', 'data')] + _REPLICATED_TAIL,
    (2, 2): [('batch', 'data'), ('vocab', 'model'), ('mlp', 'model'), ('heads', 'model'),
             ('kv', None), ('joined_kv', 'model'), ('embed', 'model'), ('embed', 'data')]
            + _REPLICATED_TAIL,
}
# logical axes -> expected for (1,1), (2,1), (1,2), (2,2)
T5X_RESOLVED = [
    (('vocab', 'embed'), [('model', None), ('model', None), ('model', 'data'), ('model', 'data')]),
    (('embed', 'vocab'), [(None, 'model'), (None, 'model'), ('data', 'model'), ('data', 'model')]),
    (('embed', 'mlp'), [(None, 'model'), (None, 'model'), ('data', 'model'), ('data', 'model')]),
    (('mlp', 'embed'), [('model', None), ('model', None), ('model', 'data'), ('model', 'data')]),
    (('embed', 'joined_kv'), [(None, 'model'), (None, 'model'), ('data', 'model'), ('data', 'model')]),
    (('joined_kv', 'embed'), [('model', None), ('model', None), ('model', 'data'), ('model', 'data')]),
    (('embed', 'heads', 'kv'), [(None, 'model', None), (None, 'model', None), ('data', 'model', None),
                                ('data', 'model', None)]),
    (('embed',), [(None,), ('model',), ('data',), ('model',)]),
    (('heads', 'relpos_buckets'), [('model', None)] * 4),
    (('embed', 'layers', 'mlp'), [(None, None, 'model'), (None, None, 'model'),
                                  ('data', None, 'model'), ('data', None, 'model')]),
    (('batch', 'length', 'embed'), [('data', None, None), ('data', None, 'model'),
                                    ('data', None, None), ('data', None, 'model')]),
    (('batch', 'length', 'mlp'), [('data', None, 'model')] * 4),
    (('batch', 'length', 'heads', 'kv'), [('data', None, 'model', None)] * 4),
    (('foo', 'embed'), [(None, None), (None, 'model'), (None, 'data'), (None, 'model')]),
]
_T5X_CASES = [(dims, names, exp[i]) for names, exp in T5X_RESOLVED
              for i, dims in enumerate([(1, 1), (2, 1), (1, 2), (2, 2)])]


@pytest.mark.parametrize('dims,names,expected', _T5X_CASES)
def test_t5x_standard_tables(dims, names, expected):
    assert nn_partitioning.logical_to_mesh_axes(names, T5X_TABLES[dims]) == P(*expected)


# --- thread safety -----------------------------------------------------------------------

def test_threads_resolve_concurrently_with_own_rules():
    tables = [(('a', f'm{i}'), ('b', ('x', f'y{i}'))) for i in range(8)]
    errors = []
    barrier = threading.Barrier(len(tables))

    def worker(i):
        try:
            with nn.logical_axis_rules(tables[i]):
                barrier.wait()
                for _ in range(2000):
                    got = nn.logical_to_mesh_axes(('a', 'b', 'c'))
                    if got != P(f'm{i}', ('x', f'y{i}'), None) or nn.get_logical_axis_rules() is not tables[i]:
                        errors.append((i, got))
                        return
            if nn.get_logical_axis_rules() != ():
                errors.append((i, 'not restored'))
        except Exception as e:  # pragma: no cover - reported below
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(tables))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert nn.get_logical_axis_rules() == ()


# --- argument errors name the argument ----------------------------------------------------------

@pytest.mark.parametrize('names,got', [(3, 'int 3'), (2.5, 'float 2.5'),
                                       ({'a': 1}, "dict {'a': 1}")])
def test_logical_to_mesh_axes_of_a_non_sequence_names_the_argument(names, got):
    """An int gave "'int' object is not iterable" from the resolver."""
    with pytest.raises(TypeError, match=r'^logical_to_mesh_axes: array_dim_names must be a '
                                        r'sequence of logical axis names .* got ' + got):
        nn_partitioning.logical_to_mesh_axes(names, R1)
    if not isinstance(names, dict):   # (a dict of specs is a spec tree there)
        with pytest.raises(TypeError, match=r'^with_logical_constraint: array_dim_names'):
            nn_partitioning.with_sharding_constraint(1.0, names, rules=R1)


def test_logical_to_mesh_axes_of_a_string_is_an_error_not_its_characters():
    """Flax resolves the characters of 'foo' as three names; a string is a slip for ('foo',)."""
    with pytest.raises(TypeError, match=r"not the string 'foo'; for a 1-d array write \('foo',\)"):
        nn_partitioning.logical_to_mesh_axes('foo', R1)
    assert nn_partitioning.logical_to_mesh_axes(['foo'], R1) == P('data')


# --- strict rules ---------------------------------------------------------------------------------

def test_strict_axis_rules_raise_for_a_name_no_rule_matches():
    with nn_partitioning.axis_rules(R1, strict=True) as ctx:
        assert ctx is None
        got = nn_partitioning.logical_to_mesh_axes(('foo', None, 'bar'))
        assert got == P('data', None, 'model')
        with pytest.raises(ValueError, match=r"logical axis name 'fooo' of \('fooo', 'bar'\) "
                                             r"matches no rule of axis_rules\(\.\.\., "
                                             r"strict=True\)"):
            nn_partitioning.logical_to_mesh_axes(('fooo', 'bar'))
        with pytest.raises(ValueError, match="'qux'"):
            nn_partitioning.with_sharding_constraint(1.0, ('foo', 'qux'))
        # a name whose rule lost its mesh axis to another dimension matches a rule: no error
        assert nn_partitioning.logical_to_mesh_axes(('baz', 'foo')) == P(None, 'data')
        # explicit other rules, and a nested non-strict context, are not strict
        assert nn_partitioning.logical_to_mesh_axes(('fooo',), R2) == P(None)
        with nn_partitioning.axis_rules(R2):
            assert nn_partitioning.logical_to_mesh_axes(('fooo',)) == P(None)
        with pytest.raises(ValueError, match="'fooo'"):   # strict again after the inner block
            nn_partitioning.logical_to_mesh_axes(('fooo',))
    assert nn_partitioning.get_axis_rules() == ()
    with nn_partitioning.axis_rules(R1):                  # the default stays Flax's
        assert nn_partitioning.logical_to_mesh_axes(('fooo',)) == P(None)


def test_strict_axis_rules_are_per_thread():
    seen = []
    with nn_partitioning.axis_rules(R1, strict=True):
        def other():
            with nn_partitioning.axis_rules(R1):
                seen.append(nn_partitioning.logical_to_mesh_axes(('fooo',)))
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen == [P(None)]


def test_strict_axis_rules_context_is_reentrant_and_checks_generator_names():
    ctx = nn_partitioning.axis_rules(R1, strict=True)
    with ctx:
        with ctx:
            with pytest.raises(ValueError, match="'x'"):
                nn_partitioning.logical_to_mesh_axes(n for n in ('foo', 'x'))
        assert nn_partitioning.get_axis_rules() is R1
        with pytest.raises(ValueError, match="'x'"):
            nn_partitioning.logical_to_mesh_axes(('x',))
    assert nn_partitioning.get_axis_rules() == ()
    assert nn_partitioning.logical_to_mesh_axes(('x',), R1) == P(None)
