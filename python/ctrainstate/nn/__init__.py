"""Flax-compatible ``nn`` names (mirror of the ``flax.linen`` sharding/metadata exports).

>>> from ctrainstate import nn
>>> with nn.logical_axis_rules((('mlp', 'model'),)):
...     nn.logical_to_mesh_axes(('embed', 'mlp'))
PartitionSpec(None, 'model')
"""
from . import meta, scope, spmd
from .meta import (
    PARTITION_NAME,
    AxisMetadata,
    Partitioned,
    get_partition_spec,
    get_sharding,
    replace_boxed,
    unbox,
    with_partitioning,
)
from .spmd import (
    LogicallyPartitioned,
    RulesFallback,
    get_logical_axis_rules,
    logical_axis_rules,
    logical_to_mesh,
    logical_to_mesh_axes,
    logical_to_mesh_sharding,
    set_logical_axis_rules,
    with_logical_constraint,
    with_logical_partitioning,
)

from . import initializers
from . import partitioning
from .module import Module, compact, nowrap
from .initializers import ones, ones_init, zeros, zeros_init
from .scope import DenyList
from .linear import Dense, DenseGeneral, Einsum, Embed
from .normalization import (BatchNorm, GroupNorm, InstanceNorm, LayerNorm, RMSNorm,
                            SpectralNorm, WeightNorm)
from .conv import Conv, ConvLocal, ConvTranspose
from . import pooling
from .pooling import avg_pool, max_pool, pool
from .stochastic import Dropout, merge_param
from .combinators import Sequential
from .summary import tabulate
from .transforms import checkpoint, remat
from .lifted import broadcast, scan, vmap
from .recurrent import (Bidirectional, ConvLSTMCell, GRUCell, LSTMCell, MGUCell,
                        OptimizedLSTMCell, RNN, RNNCellBase, SimpleCell)
from .transforms_more import (apply, cond, disable_named_call, enable_named_call, grad, init,
                              init_with_output, jit, jvp, map_variables, named_call,
                              override_named_call, share_scope, switch, value_and_grad, vjp,
                              while_loop)
from .scope import Variable
from ..core import FrozenDict
from .._src.numpy_lax.numpy import gelu, relu, sigmoid, tanh
from .._src.numpy_lax.numpy import sin, cos, exp, log
from .activation import leaky_relu, log_softmax, logsumexp, one_hot, silu, softmax, swish
from .activation import (celu, elu, glu, hard_sigmoid, hard_silu, hard_swish, hard_tanh,
                         log_sigmoid, normalize, PReLU, relu6, selu, soft_sign, softplus,
                         standardize)
from .attention import (
    MultiHeadAttention,
    MultiHeadDotProductAttention,
    SelfAttention,
    combine_masks,
    dot_product_attention,
    dot_product_attention_weights,
    make_attention_mask,
    make_causal_mask,
)

__all__ = [
    'initializers', 'partitioning', 'meta', 'scope', 'spmd', 'Module', 'compact', 'nowrap', 'zeros', 'ones',
    'zeros_init', 'ones_init', 'DenyList', 'Dense', 'DenseGeneral', 'Einsum', 'PReLU',
    'soft_sign', 'normalize',
    'Embed', 'LayerNorm', 'RMSNorm', 'WeightNorm', 'SpectralNorm', 'BatchNorm', 'GroupNorm', 'InstanceNorm', 'Conv',
    'ConvLocal', 'ConvTranspose', 'pooling', 'pool', 'avg_pool', 'max_pool', 'MultiHeadDotProductAttention', 'MultiHeadAttention',
    'SelfAttention', 'dot_product_attention', 'dot_product_attention_weights',
    'make_attention_mask', 'make_causal_mask', 'combine_masks', 'Dropout', 'merge_param', 'Sequential', 'tabulate', 'checkpoint', 'remat', 'scan', 'vmap', 'broadcast', 'RNNCellBase', 'LSTMCell',
    'OptimizedLSTMCell', 'GRUCell', 'SimpleCell', 'MGUCell', 'ConvLSTMCell', 'RNN',
    'Bidirectional', 'map_variables', 'vjp', 'value_and_grad', 'grad', 'jvp', 'cond',
    'switch', 'while_loop', 'jit', 'apply', 'init', 'init_with_output', 'share_scope', 'named_call',
    'enable_named_call', 'disable_named_call', 'override_named_call', 'Variable', 'FrozenDict', 'gelu', 'relu', 'sigmoid', 'tanh', 'silu', 'swish', 'leaky_relu', 'softplus', 'log_sigmoid', 'elu', 'celu', 'selu', 'relu6', 'hard_tanh', 'hard_sigmoid', 'hard_silu', 'hard_swish', 'glu', 'standardize', 'one_hot', 'softmax', 'log_softmax', 'logsumexp', 'sin', 'cos', 'exp', 'log', 'PARTITION_NAME', 'AxisMetadata', 'Partitioned', 'get_partition_spec',
    'get_sharding', 'replace_boxed', 'unbox', 'with_partitioning', 'LogicallyPartitioned',
    'RulesFallback', 'get_logical_axis_rules', 'logical_axis_rules', 'logical_to_mesh',
    'logical_to_mesh_axes', 'logical_to_mesh_sharding', 'set_logical_axis_rules',
    'with_logical_constraint', 'with_logical_partitioning',
]
