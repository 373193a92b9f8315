"""Regex partition rules (the implementation of :mod:`ctrainstate.hf.partitions`, which
re-exports it; :mod:`ctrainstate.checkpoint.pretrained` uses it too)."""
from __future__ import annotations

import re
from typing import Any, Sequence

from ..array.sharding import PartitionSpec as P

__all__ = ['match', 'set_partitions', 'gpt_neo_rules', 'gptj_rules', 'Rules']

Rules = Sequence[tuple]


def match(qs: Sequence[str], ks: Sequence[str]) -> bool:
    """True if the regexes ``qs`` fully match some window of consecutive keys in ``ks``.

    >>> from ctrainstate.hf.partitions import match
    >>> match(('ln_\\\\d+',), ('ln_12',)), match(('ln_\\\\d+',), ('ln_1x',)), match((), ('x',))
    (True, False, False)
    """
    pats = [re.compile(q) for q in qs]
    n = len(pats)
    if n == 0:
        return False
    for i in range(len(ks) - n + 1):
        if all(p.fullmatch(str(k)) for p, k in zip(pats, ks[i:i + n])):
            return True
    return False


def _flatten(tree: Any, prefix: tuple = ()) -> dict:
    if isinstance(tree, dict) and tree:
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, prefix + (k,)))
        return out
    if isinstance(tree, dict):
        return {}
    return {prefix: tree}


def _unflatten(flat: dict) -> dict:
    out: dict = {}
    for path, v in flat.items():
        d = out
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = v
    return out


def set_partitions(params: Any, rules: Rules | None = None) -> dict:
    """Map every leaf of the nested-dict ``params`` to the spec of its first matching rule.

    ``rules`` defaults to the GPT-Neo table (:func:`gpt_neo_rules`), the one HF's
    ``set_partitions(in_dict)`` applies. Raises ``ValueError`` listing the '/'-joined paths
    that no rule matches.

    >>> from ctrainstate.hf.partitions import set_partitions
    >>> set_partitions({'a': {'kernel': 0}}, [(('kernel',), None)])
    {'a': {'kernel': None}}
    >>> set_partitions({'lm_head': {'kernel': 0}}, [(('wte',), None)])
    Traceback (most recent call last):
    ...
    ValueError: Incomplete partition spec: no rule matches lm_head/kernel
    """
    if rules is None:
        rules = gpt_neo_rules()
    for i, rule in enumerate(rules):
        if isinstance(rule, str) or not hasattr(rule, '__len__') or len(rule) != 2:
            raise ValueError(f'partition rule {i} = {rule!r} is not a (regex_tuple, spec) pair')
        if isinstance(rule[0], str):  # ('wte') is a string: its characters would be the regexes
            raise ValueError(f'partition rule {i}: the regexes {rule[0]!r} are one string, not '
                             f'a tuple of strings; write ({rule[0]!r},)')
    result = {}
    missing = []
    for path in _flatten(params):
        for regexes, spec in rules:
            if match(regexes, path):
                result[path] = spec
                break
        else:
            missing.append('/'.join(map(str, path)))
    if missing:
        raise ValueError('Incomplete partition spec: no rule matches ' + ', '.join(missing))
    return _unflatten(result)


def gpt_neo_rules() -> list:
    """The GPT-Neo table: replicate the hidden dim, shard feed-forward and head dims over ``mp``."""
    return [
        # embeddings
        (('transformer', 'wpe', 'embedding'), P('mp', None)),
        (('transformer', 'wte', 'embedding'), P('mp', None)),
        # attention
        (('attention', '(q_proj|k_proj|v_proj)', 'kernel'), P(None, 'mp')),
        (('attention', 'out_proj', 'kernel'), P('mp', None)),
        (('attention', 'out_proj', 'bias'), None),
        # mlp
        (('mlp', 'c_fc', 'kernel'), P(None, 'mp')),
        (('mlp', 'c_fc', 'bias'), P('mp')),
        (('mlp', 'c_proj', 'kernel'), P('mp', None)),
        (('mlp', 'c_proj', 'bias'), None),
        # layer norms
        ((r'ln_\d+', 'bias'), None),
        ((r'\d+', r'ln_\d+', 'scale'), None),
        (('ln_f', 'bias'), None),
        (('ln_f', 'scale'), None),
    ]


def gptj_rules() -> list:
    """The GPT-J table (as used by JAXSeq; HF transformers ships none)."""
    return [
        (('transformer', 'wte', 'embedding'), P('mp', None)),
        (('attn', '(k_proj|q_proj|v_proj)', 'kernel'), P(None, 'mp')),
        (('attn', 'out_proj', 'kernel'), P('mp', None)),
        (('mlp', 'fc_in', 'kernel'), P(None, 'mp')),
        (('mlp', 'fc_in', 'bias'), P('mp')),
        (('mlp', 'fc_out', 'kernel'), P('mp', None)),
        (('mlp', 'fc_out', 'bias'), None),
        ((r'ln_\d+', 'bias'), None),
        ((r'\d+', r'ln_\d+', 'scale'), None),
        (('ln_f', 'bias'), None),
        (('ln_f', 'scale'), None),
        (('lm_head', 'kernel'), P(None, 'mp')),
        (('lm_head', 'bias'), P('mp')),
    ]
