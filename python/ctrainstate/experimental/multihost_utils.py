"""``jax.experimental.multihost_utils``: data between the processes of a job, for scripts
that use jax's path to it.

:func:`sync_global_devices`, :func:`process_allgather`, :func:`broadcast_one_to_all` and
:func:`assert_equal` work on pytrees of host data (numpy arrays, scalars, lists) and of
ctrainstate Arrays that live in this process (their values are copied to the host first),
through the MPI engine of :mod:`ctrainstate.distributed`. Without
``ctrainstate.distributed.initialize()`` they treat the process as a job of one, as jax
does. Results are numpy arrays, also where jax returns jax Arrays (``broadcast_one_to_all``).

Arrays that span processes (over a mesh of several processes' devices,
``is_fully_addressable`` False): :func:`process_allgather` returns their whole value on
every process; :func:`host_local_array_to_global_array` makes them from each process's
host-local values and :func:`global_array_to_host_local_array` takes this process's part
back, as jax's.

>>> import numpy as np
>>> from ctrainstate.experimental import multihost_utils
>>> multihost_utils.process_allgather(np.arange(3))  # one process: a stack of one
array([[0, 1, 2]])
>>> multihost_utils.process_allgather({'a': np.ones(2, np.float32)}, tiled=True)
{'a': array([1., 1.], dtype=float32)}
"""
from .._src.distributed.multihost_utils import *  # noqa: F401,F403
from .._src.distributed.multihost_utils import __all__  # noqa: F401

from .._src.base.exports import module_dir as _module_dir  # noqa: E402

__dir__ = _module_dir(__name__)   # dir(): the API (__all__), not the imports
