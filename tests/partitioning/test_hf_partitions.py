"""HF regex partition rules (t5x_hf.md §1.7, §2.5, facts F-H1..F-H3) on a GPT-Neo-shaped tree."""
import numpy as np
import pytest

from ctrainstate.hf import partitions
from ctrainstate.sharding import PartitionSpec as P


@pytest.mark.parametrize('qs,ks,expected', [
    (('ln_f', 'scale'), ('ln_f', 'scale'), True),
    (('wte',), ('transformer', 'wte', 'embedding'), True),
    (('a', 'b'), ('a',), False),
    (('ln_\\d+',), ('ln_12',), True),
    (('ln_\\d+',), ('ln_1x',), False),
    (('q',), ('qq',), False),
    ((), ('x',), False),
    (('b', 'c'), ('a', 'b', 'c'), True),
    (('a', 'c'), ('a', 'b', 'c'), False),   # windows are consecutive
])
def test_match(qs, ks, expected):   # F-H3
    assert partitions.match(qs, ks) is expected


def gpt_neo_params(n_layer=2, vocab=64, pos=16, d=8):
    z = np.zeros
    layer = {
        'ln_1': {'scale': z(d), 'bias': z(d)},
        'attn': {'attention': {'q_proj': {'kernel': z((d, d))}, 'k_proj': {'kernel': z((d, d))},
                               'v_proj': {'kernel': z((d, d))},
                               'out_proj': {'kernel': z((d, d)), 'bias': z(d)}}},
        'ln_2': {'scale': z(d), 'bias': z(d)},
        'mlp': {'c_fc': {'kernel': z((d, 4 * d)), 'bias': z(4 * d)},
                'c_proj': {'kernel': z((4 * d, d)), 'bias': z(d)}},
    }
    return {'transformer': {'wte': {'embedding': z((vocab, d))}, 'wpe': {'embedding': z((pos, d))},
                            'h': {str(i): layer for i in range(n_layer)},
                            'ln_f': {'scale': z(d), 'bias': z(d)}}}


def test_gpt_neo_table():   # F-H1
    specs = partitions.set_partitions(gpt_neo_params(), partitions.gpt_neo_rules())
    t = specs['transformer']
    assert t['wte']['embedding'] == P('mp', None) and t['wpe']['embedding'] == P('mp', None)
    assert t['ln_f'] == {'scale': None, 'bias': None}
    for i in ('0', '1'):
        h = t['h'][i]
        att = h['attn']['attention']
        for k in ('q_proj', 'k_proj', 'v_proj'):
            assert att[k]['kernel'] == P(None, 'mp')
        assert att['out_proj'] == {'kernel': P('mp', None), 'bias': None}
        assert h['mlp']['c_fc'] == {'kernel': P(None, 'mp'), 'bias': P('mp')}
        assert h['mlp']['c_proj'] == {'kernel': P('mp', None), 'bias': None}
        assert h['ln_1'] == {'scale': None, 'bias': None} and h['ln_2'] == {'scale': None, 'bias': None}


def test_specs_fit_param_ranks():
    params = gpt_neo_params()
    specs = partitions.set_partitions(params, partitions.gpt_neo_rules())
    from ctrainstate import tree_util
    flat_p = tree_util.tree_leaves(params)
    flat_s = tree_util.tree_leaves(specs, is_leaf=lambda x: x is None or isinstance(x, P))
    assert len(flat_p) == len(flat_s)
    for p, s in zip(flat_p, flat_s):
        assert s is None or len(s) <= p.ndim


@pytest.mark.parametrize('extra,path', [
    ({'lm_head': {'kernel': np.zeros((8, 64))}}, 'lm_head/kernel'),
    ({'q_proj': {'kernel': np.zeros((8, 8))}}, 'q_proj/kernel'),
])
def test_unmatched_leaf_names_path(extra, path):   # F-H2, with a path instead of a bare assert
    params = gpt_neo_params()
    params.update(extra)
    with pytest.raises(ValueError, match='Incomplete partition spec: no rule matches ' + path):
        partitions.set_partitions(params, partitions.gpt_neo_rules())


def test_unmatched_nested_leaf():
    params = gpt_neo_params()
    params['transformer']['h']['0']['ln_1']['weight'] = np.zeros(8)
    with pytest.raises(ValueError, match='transformer/h/0/ln_1/weight'):
        partitions.set_partitions(params, partitions.gpt_neo_rules())


def test_first_matching_rule_wins():
    rules = [(('kernel',), P('a')), (('dense', 'kernel'), P('b'))]
    assert partitions.set_partitions({'dense': {'kernel': 0}}, rules) == {'dense': {'kernel': P('a')}}


def test_gptj_table():
    d = 8
    z = np.zeros
    params = {'transformer': {'wte': {'embedding': z((64, d))},
                              'h': {'0': {'ln_1': {'scale': z(d), 'bias': z(d)},
                                          'attn': {'q_proj': {'kernel': z((d, d))},
                                                   'k_proj': {'kernel': z((d, d))},
                                                   'v_proj': {'kernel': z((d, d))},
                                                   'out_proj': {'kernel': z((d, d))}},
                                          'mlp': {'fc_in': {'kernel': z((d, 4 * d)), 'bias': z(4 * d)},
                                                  'fc_out': {'kernel': z((4 * d, d)), 'bias': z(d)}}}},
                              'ln_f': {'scale': z(d), 'bias': z(d)}},
              'lm_head': {'kernel': z((d, 64)), 'bias': z(64)}}
    s = partitions.set_partitions(params, partitions.gptj_rules())
    h = s['transformer']['h']['0']
    assert s['transformer']['wte']['embedding'] == P('mp', None)
    assert h['attn']['q_proj']['kernel'] == P(None, 'mp') and h['attn']['out_proj']['kernel'] == P('mp', None)
    assert h['mlp']['fc_in'] == {'kernel': P(None, 'mp'), 'bias': P('mp')}
    assert h['mlp']['fc_out'] == {'kernel': P('mp', None), 'bias': None}
    assert s['lm_head'] == {'kernel': P(None, 'mp'), 'bias': P('mp')}
    assert h['ln_1'] == {'scale': None, 'bias': None}


# --- regression tests for parity bugs found in set_partitions (expectations from
# shared/reference/t5x_hf.md)

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
