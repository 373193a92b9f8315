"""Recorded jax/flax/optax values: the store behind conftest's `jax_ref` fixture.

A test that compares with jax asks ``jax_ref(key, lambda jax: ...)`` for each value of jax's side. The fixture
has two parameters, so the test runs twice:

- ``[recorded]`` (the README's test command): returns the value recorded for that key in
  ``tests/data/recorded/<test module>.npz``; ``fn`` is not called and jax is not imported. A
  missing recording fails the test.
- ``[live]`` (marked ``parity``): calls ``fn(jax)`` (jax computes it) and checks that the recording
  holds the same value (bit for bit unless the call gives ``rtol``/``atol``), so a stale or
  missing recording fails the parity run; under ``--record-vectors`` (tools/record_vectors.py)
  it stores the value instead.

Values are arrays (any numpy or ml_dtypes dtype, jax arrays), Python scalars and strings, None,
and dicts / lists / tuples of them. Keys are per test (the test's name, with its parameters
other than jax_ref's, is the prefix). A file is a plain .npz: for each key, an entry ``KEY`` with
the value's structure as JSON, and ``KEY#i`` for its i-th array (16-bit and 8-bit float dtypes
stored as unsigned integers of their width); ``__meta__`` holds the jax/flax/optax versions.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "recorded")
META = "__meta__"
_SCALARS = (bool, int, float, complex, str)


def _flatten(v, leaves: list, xs: list | None = None):
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise TypeError(f"recorded dict keys must be str, got {list(v)}")
        return {"d": [[k, _flatten(x, leaves, xs)] for k, x in v.items()]}
    if isinstance(v, (list, tuple)):
        return {"t" if isinstance(v, tuple) else "l": [_flatten(x, leaves, xs) for x in v]}
    if v is None:
        return {"n": 0}
    spec = {}
    if isinstance(v, _SCALARS) and not isinstance(v, np.generic):
        spec["s"] = type(v).__name__
    a = np.asarray(v)
    if a.dtype.kind == "O":
        raise TypeError(f"cannot record a value of type {type(v).__name__}")
    if a.dtype.kind == "V" or type(a.dtype).__module__.startswith("ml_dtypes") or \
            a.dtype.name in ("bfloat16",) or a.dtype.name.startswith("float8") or \
            a.dtype.name.startswith("float4") or a.dtype.name.startswith("int4") or \
            a.dtype.name.startswith("uint4"):
        spec["x"] = a.dtype.name
        a = a.view(f"u{a.dtype.itemsize}")
    spec["a"] = len(leaves)
    leaves.append(np.asarray(a, order="C"))  # (ascontiguousarray would make 0-d 1-d)
    if xs is not None:
        xs.append(spec.get("x"))
    return spec


def _unflatten(spec, leaves):
    if "d" in spec:
        return {k: _unflatten(s, leaves) for k, s in spec["d"]}
    if "t" in spec:
        return tuple(_unflatten(s, leaves) for s in spec["t"])
    if "l" in spec:
        return [_unflatten(s, leaves) for s in spec["l"]]
    if "n" in spec:
        return None
    a = leaves[spec["a"]]
    if "x" in spec:
        import ml_dtypes  # noqa: F401  (registers the dtype names)
        a = a.view(np.dtype(spec["x"]))
    if "s" in spec:
        return {"bool": bool, "int": int, "float": float, "complex": complex,
                "str": str}[spec["s"]](a[()])
    return a


def to_numpy(v):
    """v (jax arrays and all) as it will read back from a recording."""
    leaves: list = []
    spec = _flatten(v, leaves)
    return _unflatten(json.loads(json.dumps(spec)), leaves)


def _same(want, got, rtol, atol, where):
    """Raise AssertionError if got (live) differs from want (recorded): bit for bit, or within
    rtol/atol for floating-point leaves when either is given."""
    lw, lg, xs = [], [], []
    sw, sg = _flatten(want, lw, xs), _flatten(got, lg)
    if sw != sg:
        raise AssertionError(f"{where}: recorded structure/dtype {sw} != live {sg}")
    for i, (a, b, x) in enumerate(zip(lw, lg, xs)):
        what = f"{where}: leaf {i}"
        if a.shape != b.shape:
            raise AssertionError(f"{what}: recorded shape {a.shape} != live {b.shape}")
        if x is not None:  # a 16/8-bit float kept as its bits
            import ml_dtypes  # noqa: F401
            a, b = a.view(np.dtype(x)), b.view(np.dtype(x))
        if (rtol or atol) and (a.dtype.kind in "fc" or x is not None):
            a64, b64 = a.astype(np.complex128 if a.dtype.kind == "c" else np.float64), \
                b.astype(np.complex128 if b.dtype.kind == "c" else np.float64)
            np.testing.assert_allclose(b64, a64, rtol=rtol, atol=atol, equal_nan=True,
                                       err_msg=what)
        elif a.dtype.kind in "US":
            np.testing.assert_array_equal(b, a, err_msg=what)
        elif a.tobytes() != b.tobytes():
            np.testing.assert_array_equal(b, a, err_msg=f"{what} (bits)")
            raise AssertionError(f"{what}: the same values, different bits")


class Store:
    """The recordings of one session: read lazily per module, written at the end in record
    mode."""

    def __init__(self):
        self._files: dict[str, object] = {}
        self._new: dict[str, dict[str, tuple]] = {}   # module -> key -> (spec, leaves)
        self._replaced: dict[str, set[str]] = {}      # module -> test prefixes recorded anew

    @staticmethod
    def path(module: str) -> str:
        return os.path.join(DIR, module + ".npz")

    def _file(self, module):
        if module not in self._files:
            p = self.path(module)
            self._files[module] = np.load(p, allow_pickle=False) if os.path.exists(p) else None
        return self._files[module]

    def get(self, module: str, key: str):
        """The recorded value, or raise KeyError."""
        f = self._file(module)
        if f is None or key not in f.files:
            raise KeyError(key)
        spec = json.loads(str(f[key][()]))
        leaves = []
        i = 0
        while f"{key}#{i}" in f.files:
            leaves.append(f[f"{key}#{i}"])
            i += 1
        return _unflatten(spec, leaves)

    def put(self, module: str, prefix: str, key: str, value) -> None:
        leaves: list = []
        spec = _flatten(value, leaves)
        mod = self._new.setdefault(module, {})
        if key in mod and (mod[key][0] != spec or any(
                a.tobytes() != b.tobytes() for a, b in zip(mod[key][1], leaves))):
            raise AssertionError(f"{module}: key {key} recorded twice with different values")
        mod[key] = (spec, leaves)
        self._replaced.setdefault(module, set()).add(prefix)

    def write(self, meta: dict) -> list[str]:
        """Write the modules recorded in this session (keys of the tests recorded anew replace
        theirs; other tests' keys are kept). Returns the paths written."""
        os.makedirs(DIR, exist_ok=True)
        written = []
        for module, new in sorted(self._new.items()):
            out = {}
            old = self._file(module)
            prefixes = self._replaced[module]
            if old is not None:
                for k in old.files:
                    if k == META or any(k.startswith(p) for p in prefixes):
                        continue
                    out[k] = old[k]
                old.close()
                self._files.pop(module, None)
            for key, (spec, leaves) in new.items():
                out[key] = np.array(json.dumps(spec, sort_keys=True))
                for i, a in enumerate(leaves):
                    out[f"{key}#{i}"] = a
            out[META] = np.array(json.dumps(meta, sort_keys=True))
            p = self.path(module)
            np.savez_compressed(p, **out)
            written.append(p)
        return written


def versions() -> dict:
    """The installed jax, jaxlib, flax and optax versions (those that are imported)."""
    out = {}
    for m in ("jax", "jaxlib", "flax", "optax"):
        mod = sys.modules.get(m)
        if mod is not None:
            out[m] = getattr(mod, "__version__", "?")
    return out


def read_meta(path: str) -> dict:
    with np.load(path, allow_pickle=False) as f:
        return json.loads(str(f[META][()])) if META in f.files else {}


def bits_digest(a) -> str:
    """A digest of an array's dtype, shape and bits, every NaN counted as one (for recording a
    large exact result as a short string)."""
    import hashlib
    a = np.asarray(a, order="C")
    if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
        a = a.copy()
        a[np.isnan(a.astype(np.float32))] = np.nan
    h = hashlib.sha256(f"{a.dtype.name}{a.shape}".encode())
    h.update(a.tobytes())
    return h.hexdigest()
