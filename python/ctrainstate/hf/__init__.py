"""Helpers for ports of HuggingFace Flax examples: regex partition rules (``partitions``),
the dropout-rng ``TrainState`` and pmap helpers (``train_state``), run_clm_mp-style specs
(``model_parallel``) and block-wise dtype casts (``cast``).

>>> from ctrainstate.hf import partitions
>>> partitions.match(('ln_f', 'scale'), ('transformer', 'ln_f', 'scale'))
True
"""
from . import partitions, cast, model_parallel, train_state
from .cast import to_bf16, to_fp16, to_fp32
from .model_parallel import opt_state_spec, train_state_spec
from .train_state import (TrainState, get_metrics, onehot, pad_shard_unpad, prefetch_to_device,
                          replicate, shard, shard_prng_key, stack_forest, unreplicate)

__all__ = ['partitions', 'cast', 'model_parallel', 'train_state', 'TrainState', 'replicate',
           'unreplicate', 'shard', 'shard_prng_key', 'opt_state_spec', 'train_state_spec',
           'to_bf16', 'to_fp16', 'to_fp32', 'onehot', 'get_metrics', 'stack_forest',
           'prefetch_to_device', 'pad_shard_unpad']
