"""Devices: CPU virtual devices (and GPUs once the CUDA backend exists).

The number of CPU devices is read from ``CTRAINSTATE_NUM_CPU_DEVICES`` the first
time devices are used (default 1), like XLA's
``--xla_force_host_platform_device_count``. An optional per-device memory limit
in bytes comes from ``CTRAINSTATE_CPU_DEVICE_MEMORY``. :mod:`ctrainstate.config`
sets both before that first use (``config.update("jax_num_cpu_devices", 8)``) and
refuses to change them after it.
"""
from __future__ import annotations

import importlib.util
import warnings
import glob
import os
import threading

from ... import _C

# The CUDA backend is a separate library that the core loads with dlopen() the
# first time devices are used; tell it where the library is (if it was built). Where the
# variable names this package's own library (set here, or inherited from a parent process),
# the core first checks for the NVIDIA driver: on a machine without one it skips loading the
# backend and its cuBLAS (0.1 s of every process's first device use). A library named
# otherwise (tools/'s host emulations of the backend) is loaded as it is.
_cuda_libs = glob.glob(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                                    "_cuda_backend*.so"))   # in the package directory
if _cuda_libs and not os.environ.get("CTRAINSTATE_CUDA_BACKEND"):
    os.environ["CTRAINSTATE_CUDA_BACKEND"] = _cuda_libs[0]
if _cuda_libs and os.environ["CTRAINSTATE_CUDA_BACKEND"] == _cuda_libs[0]:
    try:
        _C.devices_set_cuda_backend(_cuda_libs[0])
    except ValueError:   # this module re-run (autoreload) after the probe: nothing to name
        pass


def _warn_forked_single_threaded() -> None:
    """In a fork()ed child of a process that ran multi-threaded CPU kernels, say once that
    they run on one thread here: OpenMP's thread pool does not survive fork, and a kernel
    that waited for it would hang (the C core runs such a child's kernels on one thread)."""
    if _C.forked_single_threaded():
        warnings.warn(
            "ctrainstate: this process was fork()ed after CPU kernels had started OpenMP "
            "threads, which do not survive fork; kernels run on one thread in this process. "
            "Use the 'spawn' or 'forkserver' start method (multiprocessing.get_context('spawn'), "
            "DataLoader(multiprocessing_context='spawn')) for parallel kernels in workers.",
            RuntimeWarning, stacklevel=2)


os.register_at_fork(after_in_child=_warn_forked_single_threaded)


def _nccl_from_wheel() -> str | None:
    """libnccl.so.2 of the nvidia-nccl-cu13 (or -cu12) wheel, if one is installed."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return None
    for d in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(d, "lib", "libnccl.so.2")
        if os.path.exists(path):
            return path
    return None


# NCCL (all-reduce across distinct GPUs) is loaded by the CUDA backend only when a
# collective spans GPUs; point it at the wheel's library unless told otherwise (it
# also looks on the loader's path, $NCCL_HOME and the CUDA toolkit).
if _cuda_libs and not os.environ.get("CTRAINSTATE_NCCL_LIB"):
    _wheel_nccl = _nccl_from_wheel()
    if _wheel_nccl:
        os.environ["CTRAINSTATE_NCCL_LIB"] = _wheel_nccl

_lock = threading.Lock()
_by_id: dict[int, "Device"] = {}
_platform_ids: dict[str, list[int]] = {}
# The devices of every process of a job (set once by _set_processes, from
# ctrainstate.distributed.initialize): this process's index, the number of processes, and
# per platform the global ids of this process's devices. Before that: one process.
_process = {"index": 0, "count": 1}
_local_ids: dict[str, list[int]] = {}
# Whether the core has created its devices (it reads its environment settings then, once).
_created = False
# The CPU device count ctrainstate.config asked for (None: not set through config).
_requested_cpu: int | None = None
# ctrainstate.config's jax_platforms: the platforms in order of preference, or None for all.
_platforms: tuple | None = None
_mismatch = ""


def _mark_created() -> None:
    """Record that the core created its devices; check that a count set through
    ctrainstate.config was the one used (the core may have been reached directly first)."""
    global _created, _mismatch
    if not _created:
        _created = True
        n = len(_C.device_ids("cpu"))
        if _requested_cpu is not None and n != _requested_cpu:
            _mismatch = (f"config: jax_num_cpu_devices was set to {_requested_cpu} but the "
                         f"devices had already been created with {n} CPU devices; set it "
                         f"before anything uses devices")
    if _mismatch:
        raise RuntimeError(_mismatch)


class Device:
    """One device. Instances are unique per id, so ``is`` and ``==`` agree.

    >>> import ctrainstate
    >>> d = ctrainstate.devices()[0]
    >>> d.platform, d.id
    ('cpu', 0)
    """

    __slots__ = ("id", "platform", "_process_index", "__weakref__")

    def __init__(self, id: int, platform: str, process_index: int = 0):  # noqa: A002
        self.id = id
        self.platform = platform
        self._process_index = process_index

    @property
    def device_kind(self) -> str:
        return "cpu" if self.platform == "cpu" else "NVIDIA GPU"

    @property
    def process_index(self) -> int:
        """The process that owns the device (0 in a job of one process)."""
        return self._process_index

    @property
    def host_id(self) -> int:
        """``process_index`` (jax's older name)."""
        return self._process_index

    def _is_local(self) -> bool:
        return self._process_index == _process["index"]

    def memory_stats(self) -> dict:
        """Bytes in use, the peak since the last reset, and the limit of this device.

        Keys: ``bytes_in_use``, ``peak_bytes_in_use``, ``bytes_limit`` (a very
        large number when no limit is set), ``num_allocs``, ``largest_alloc_size``.
        """
        return _C.memory_stats(self.id)

    def synchronize(self) -> None:
        _C.synchronize(self.id)

    def __repr__(self) -> str:
        kind = "CpuDevice" if self.platform == "cpu" else "CudaDevice"
        if _process["count"] > 1:
            return f"{kind}(id={self.id}, process_index={self._process_index})"
        return f"{kind}(id={self.id})"

    def __reduce__(self):
        return (_device_by_id, (self.id,))


def _ids(platform: str) -> list[int]:
    """The global ids of ``platform``'s devices, of every process."""
    with _lock:
        ids = _platform_ids.get(platform)
        if ids is None:
            _mark_created()
            ids = list(_C.device_ids(platform))
            _platform_ids[platform] = ids
            _local_ids[platform] = ids
            for i in ids:
                _by_id.setdefault(i, Device(i, platform))
        return ids


def _local_platform_ids(platform: str) -> list[int]:
    """The global ids of this process's devices of ``platform``."""
    _ids(platform)
    return _local_ids[platform]


def _devices_used() -> bool:
    """Whether Device objects exist in this process (they carry ids that a job of several
    processes would change)."""
    return bool(_by_id)


def _set_processes(index: int, counts) -> None:
    """Make the devices global: ``counts[p]`` is ``(CPU devices, GPU devices)`` of process
    ``p``. Process ``p``'s devices get the ids after those of the processes before it (its
    CPU devices, then its GPUs), so ids are unique and ordered by process; ``devices()``
    lists every process's, ``local_devices()`` this process's. Called once, by
    ``ctrainstate.distributed.initialize``, before any Device of this process exists
    (RuntimeError otherwise)."""
    with _lock:
        if _by_id and _process["count"] == 1 and len(counts) > 1:
            raise RuntimeError(
                "ctrainstate.distributed.initialize() must be called before ctrainstate uses "
                "devices (devices(), device_put, a Mesh, ...) in a job of several processes: "
                "the devices get global ids then")
        if _process["count"] > 1:
            raise RuntimeError("the devices of a job of several processes are set once")
        offsets, total = [], 0
        for cpu, gpu in counts:
            offsets.append(total)
            total += int(cpu) + int(gpu)
        ncpu, ngpu = (int(c) for c in counts[index])
        if len(_C.device_ids("cpu")) != ncpu or len(_C.device_ids("gpu")) != ngpu:
            raise RuntimeError("internal error: this process's device counts changed")
        _C.devices_set_id_offset(offsets[index], total)
        _process.update(index=int(index), count=len(counts))
        for platform, col in (("cpu", 0), ("gpu", 1)):
            ids = []
            for p, (off, c) in enumerate(zip(offsets, counts)):
                first = off + (0 if col == 0 else int(c[0]))
                for i in range(first, first + int(c[col])):
                    ids.append(i)
                    _by_id.setdefault(i, Device(i, platform, p))
            _platform_ids[platform] = ids
            _local_ids[platform] = [i for i in ids if _by_id[i]._process_index == index]


def _device_by_id(i: int) -> Device:
    _ids("cpu")
    _ids("gpu")
    try:
        return _by_id[i]
    except KeyError:
        raise ValueError(f"no device with id {i}") from None


def _normalize_backend(backend):
    if backend is None:
        return None
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string like 'cpu' or 'gpu', got {backend!r}")
    b = backend.lower()
    if b == "cuda":
        b = "gpu"
    if b not in ("cpu", "gpu"):
        raise ValueError(f"unknown backend {backend!r}; expected 'cpu' or 'gpu'")
    return b


def default_backend() -> str:
    """'gpu' when GPU devices exist, else 'cpu' (with ``config.update("jax_platforms",
    ...)``: the first listed platform that has devices)."""
    if _platforms is not None:
        for p in _platforms:
            if _ids(p):
                return p
        raise RuntimeError(f"no devices of the platforms {','.join(_platforms)!r} set by "
                           f"jax_platforms: {_C.gpu_status()}")
    return "gpu" if _ids("gpu") else "cpu"


def devices(backend: str | None = None) -> list[Device]:
    """All devices of ``backend`` ('cpu' or 'gpu'); by default the default backend's.

    >>> import ctrainstate
    >>> ctrainstate.devices('cpu')[0]
    CpuDevice(id=0)
    """
    b = _normalize_backend(backend) or default_backend()
    if _platforms is not None and b not in _platforms:
        raise RuntimeError(f"backend {b!r} is not among the platforms set by jax_platforms "
                           f"({','.join(_platforms)!r})")
    ids = _ids(b)
    if not ids:
        raise RuntimeError(f"no {b} devices: {_C.gpu_status()}")
    return [_by_id[i] for i in ids]


def local_devices(process_index: int | None = None, backend: str | None = None) -> list[Device]:
    """The devices of process ``process_index`` (default: this process) of ``backend``.
    In a job of one process, all devices.

    >>> import ctrainstate
    >>> ctrainstate.local_devices() == ctrainstate.devices()   # one process
    True
    """
    n = _process["count"]
    if process_index is not None:
        if isinstance(process_index, bool) or not isinstance(process_index, int):
            raise TypeError(f"process_index must be an int, got {process_index!r}")
        if not 0 <= process_index < n:
            raise ValueError(f"process_index {process_index} does not exist; there "
                             f"{'is one process (0)' if n == 1 else f'are {n} processes'}")
    if n == 1:
        return devices(backend)
    p = _process["index"] if process_index is None else process_index
    return [d for d in devices(backend) if d._process_index == p]


def device_count(backend: str | None = None) -> int:
    """Number of devices of ``backend`` (default backend when None), of every process."""
    return len(devices(backend))


def local_device_count(backend: str | None = None) -> int:
    """Number of this process's devices of ``backend`` (default backend when None)."""
    return len(local_devices(backend=backend))


def process_index() -> int:
    """This process's index in the job (``jax.process_index``): 0 in a job of one process;
    set by ``ctrainstate.distributed.initialize``."""
    return _process["index"]


def process_count() -> int:
    """The number of processes of the job (``jax.process_count``): 1 unless
    ``ctrainstate.distributed.initialize`` joined several."""
    return _process["count"]


def gpu_status() -> str:
    """One line saying whether the CUDA backend found GPUs, or why not.

    >>> import ctrainstate
    >>> isinstance(ctrainstate.gpu_status(), str)
    True
    """
    _ids("cpu")
    return _C.gpu_status()


def reset_peak_memory_stats() -> None:
    """Set every device's ``peak_bytes_in_use`` to its current ``bytes_in_use``."""
    _ids("cpu")
    _C.reset_peak_memory_stats()
