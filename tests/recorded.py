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
other than jax_ref's). A file is a plain .npz (see Store: per test, a JSON index and one blob
of bytes; 16-bit and 8-bit float dtypes stored as unsigned integers of their width);
``__meta__`` holds the jax/flax/optax versions.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
from importlib import metadata

import numpy as np

TESTS = os.path.dirname(os.path.abspath(__file__))   # tests/
DIR = os.path.join(TESTS, "data", "recorded")
META = "__meta__"
SHARED = "__shared__"   # the prefix of jax_ref(..., shared=True) keys
_SCALARS = (bool, int, float, complex, str)


def dtype(name: str) -> np.dtype:
    """The dtype of that name, ml_dtypes' (bfloat16, float8_*) too, whatever the version of
    numpy / ml_dtypes (np.dtype("bfloat16") needs a recent ml_dtypes)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, name))


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
        a = a.view(dtype(spec["x"]))
    if "s" in spec:
        return {"bool": bool, "int": int, "float": float, "complex": complex,
                "str": str}[spec["s"]](a[()])
    return a


def to_numpy(v):
    """v (jax arrays and all) as it will read back from a recording."""
    leaves: list = []
    spec = _flatten(v, leaves)
    return _unflatten(json.loads(json.dumps(spec)), leaves)


# XLA compiles jax's CPU programs for the host's CPU model (LLVM's instruction choice and
# fusion, XLA's rsqrt approximation), so the same jax can round the last bits differently on
# another model: recorded on AMD EPYC VMs, 9 of the 900 live tests differed from their
# recordings on a 2-vCPU Intel Xeon (Ice Lake, AVX-512) VM by 1 to a few ulps (float32 rsqrt,
# standardize, orthogonal's QR, the gamma and ball samplers). A recording is checked bit for
# bit on the CPU model it was made on; on another model its floating-point leaves may differ by
# up to CROSS_CPU_ULPS ulps of their dtype, of the value or of the leaf's largest magnitude
# (and nothing else may differ), and the test gets the
# live value as it does everywhere (tests that need jax's bits on this host, e.g. XLA's rsqrt,
# take them from the live jax).
CROSS_CPU_ULPS = 16
# The machines the recordings without a "cpu" entry in their __meta__ were made on: the
# vendor only (their models were not kept).
UNKNOWN_RECORDING_CPU = "AuthenticAMD"


def host_cpu() -> str:
    """This machine's CPU model as "vendor family model" (/proc/cpuinfo), or "" if unknown."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                k = k.strip()
                if k in ("vendor_id", "cpu family", "model") and k not in fields:
                    fields[k] = v.strip()
                if not line.strip() and fields:
                    break
    except OSError:
        return ""
    return " ".join(fields.get(k, "?") for k in ("vendor_id", "cpu family", "model"))


def same_cpu(recorded_cpu: str | None, host: str | None = None) -> bool:
    """Whether recordings made on `recorded_cpu` (meta's "cpu"; None: not kept) came from this
    machine's CPU model."""
    host = host_cpu() if host is None else host
    if not host:
        return False
    if recorded_cpu is None:   # (the model unknown: a host of that vendor is held to the bits)
        return host.split()[0] == UNKNOWN_RECORDING_CPU
    return recorded_cpu == host


def ulps_apart(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise distance in ulps of a and b (the same float dtype, 16/32/64-bit or an
    ml_dtypes float): adjacent values differ by 1, +0.0 and -0.0 by 0; NaN against NaN is 0,
    NaN against a number is the dtype's whole range."""
    bits = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]
    def line(v):
        i = np.ascontiguousarray(v).view(bits).astype(np.int64)
        return np.where(i < 0, -(i & np.iinfo(bits).max), i)
    d = np.abs(line(a) - line(b))
    na, nb = np.isnan(a.astype(np.float64)), np.isnan(b.astype(np.float64))
    return np.where(na & nb, 0, np.where(na | nb, np.iinfo(np.int64).max, d))


def _same(want, got, rtol, atol, where, cross_cpu=False):
    """Raise AssertionError if got (live) differs from want (recorded): bit for bit, or within
    rtol/atol for floating-point leaves when either is given. `cross_cpu` (the recording came
    from another CPU model): floating-point leaves that are not bit for bit may also be within
    CROSS_CPU_ULPS ulps, of each value or of the leaf's largest magnitude."""
    lw, lg, xs = [], [], []
    sw, sg = _flatten(want, lw, xs), _flatten(got, lg)
    if sw != sg:
        raise AssertionError(f"{where}: recorded structure/dtype {sw} != live {sg}")
    for i, (a, b, x) in enumerate(zip(lw, lg, xs)):
        what = f"{where}: leaf {i}"
        if a.shape != b.shape:
            raise AssertionError(f"{what}: recorded shape {a.shape} != live {b.shape}")
        if x is not None:  # a 16/8-bit float kept as its bits
            a, b = a.view(dtype(x)), b.view(dtype(x))
        is_float = a.dtype.kind == "f" or x is not None
        if (rtol or atol) and (is_float or a.dtype.kind == "c"):
            a64, b64 = a.astype(np.complex128 if a.dtype.kind == "c" else np.float64), \
                b.astype(np.complex128 if b.dtype.kind == "c" else np.float64)
            np.testing.assert_allclose(b64, a64, rtol=rtol, atol=atol, equal_nan=True,
                                       err_msg=what)
        elif a.dtype.kind in "US":
            np.testing.assert_array_equal(b, a, err_msg=what)
        elif a.tobytes() != b.tobytes():
            if cross_cpu and (is_float or a.dtype.kind == "c") and a.size:
                real = (lambda v: v.view(np.float32 if v.dtype == np.complex64 else np.float64)
                        ) if a.dtype.kind == "c" else (lambda v: v)
                a_, b_ = real(a), real(b)
                # elementwise, or (values cancelled toward zero: a gradient that sums to
                # nothing, a QR's small entries) against the leaf's largest magnitude
                w = a_.astype(np.float64)
                top = np.abs(w[np.isfinite(w)]).max(initial=0).astype(a_.dtype)
                far = ulps_apart(a_, b_) > CROSS_CPU_ULPS
                far &= ~(np.abs(w - b_.astype(np.float64)) <=
                         CROSS_CPU_ULPS * np.spacing(top).astype(np.float64))
                if not far.any():
                    continue
                i = int(np.argmax(far.ravel()))
                raise AssertionError(
                    f"{what}: recorded {a_.ravel()[i]!r}, live {b_.ravel()[i]!r} (flat index "
                    f"{i}): more than {CROSS_CPU_ULPS} ulps apart, of the value and of the "
                    f"leaf's largest magnitude {top!r}, allowed where the recording was made on "
                    f"another CPU model")
            np.testing.assert_array_equal(b, a, err_msg=f"{what} (bits)")
            raise AssertionError(f"{what}: the same values, different bits")


class Store:
    """The recordings of one session: read lazily per module, written at the end in record
    mode. A file holds, per test (its key prefix P), an entry ``P`` with the JSON of each key's
    structure and leaves (offset, size, dtype, shape) and an entry ``P#`` with all the leaves'
    bytes (one blob a test: a few thousand small keys cost a few kilobytes, not an npz member
    each)."""

    def __init__(self):
        self._files: dict[str, object] = {}
        self._tests: dict[tuple, tuple] = {}         # (module, prefix) -> (index, blob)
        self._new: dict[str, dict[str, dict]] = {}   # module -> prefix -> key -> (spec, leaves)

    @staticmethod
    def path(module: str) -> str:
        return os.path.join(DIR, module + ".npz")

    def _file(self, module):
        if module not in self._files:
            p = self.path(module)
            self._files[module] = np.load(p, allow_pickle=False) if os.path.exists(p) else None
        return self._files[module]

    def meta(self, module: str) -> dict:
        """The module's recording's __meta__ (versions, the CPU model), {} if none."""
        f = self._file(module)
        return json.loads(str(f[META][()])) if f is not None and META in f.files else {}

    def get(self, module: str, prefix: str, key: str):
        """The recorded value, or raise KeyError."""
        if (module, prefix) not in self._tests:
            f = self._file(module)
            if f is None or prefix not in f.files:
                raise KeyError(key)
            self._tests[module, prefix] = (json.loads(str(f[prefix][()])), f[prefix + "#"])
        index, blob = self._tests[module, prefix]
        if key not in index:
            raise KeyError(key)
        spec, table = index[key]
        leaves = [blob[off:off + n].view(np.dtype(dt)).reshape(shape)
                  for off, n, dt, shape in table]
        return _unflatten(spec, leaves)

    def put(self, module: str, prefix: str, key: str, value) -> None:
        leaves: list = []
        spec = _flatten(value, leaves)
        self._new.setdefault(module, {}).setdefault(prefix, {})[key] = (spec, leaves)

    def write(self, meta: dict) -> list[str]:
        """Write the modules recorded in this session (the tests recorded anew replace theirs;
        other tests' recordings are kept). Returns the paths written."""
        os.makedirs(DIR, exist_ok=True)
        written = []
        for module, tests in sorted(self._new.items()):
            out = {}
            old = self._file(module)
            if old is not None and SHARED in tests and SHARED in old.files:
                # shared keys of tests not run this time are kept
                for key in json.loads(str(old[SHARED][()])):
                    if key not in tests[SHARED]:
                        v = self.get(module, SHARED, key)
                        leaves: list = []
                        tests[SHARED][key] = (_flatten(v, leaves), leaves)
            if old is not None:
                for k in old.files:
                    if k != META and k.rstrip("#") not in tests:
                        out[k] = old[k]
                old.close()
                self._files.pop(module, None)
            for prefix, keys in sorted(tests.items()):
                index, parts, off = {}, [], 0
                for key, (spec, leaves) in keys.items():
                    table = []
                    for a in leaves:
                        b = a.tobytes()
                        table.append([off, len(b), a.dtype.str, list(a.shape)])
                        parts.append(b)
                        off += len(b)
                    index[key] = [spec, table]
                out[prefix] = np.array(json.dumps(index, sort_keys=True))
                out[prefix + "#"] = np.frombuffer(b"".join(parts), np.uint8)
            out[META] = np.array(json.dumps(meta, sort_keys=True))
            p = self.path(module)
            _savez(p, out)
            written.append(p)
        return written


def _savez(path: str, arrays: dict) -> None:
    """np.savez_compressed, byte for byte the same for the same arrays (entries sorted, no
    timestamps): recording anew with the same jax leaves git nothing to show."""
    import io
    import zipfile
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asanyarray(arrays[name]), allow_pickle=False)
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            z.writestr(info, buf.getvalue())


class JaxRef:
    """jax's side of a comparison in one test, live or recorded: conftest's `jax_ref` fixture."""

    def __init__(self, store: Store, module: str, test: str, live: bool, record: bool,
                 jax_module=None):
        self.live = live
        self.jax = jax_module   # the jax module in the live twin (None in the recorded one)
        self._store, self._module, self._prefix, self._record = store, module, test, record
        self._seen: dict = {}
        self._count = 0

    @property
    def same_cpu(self) -> bool:
        """Whether this module's recordings were made on this machine's CPU model (else jax's
        live values may differ from them in the last bits: see CROSS_CPU_ULPS)."""
        return same_cpu(self._store.meta(self._module).get("cpu"))

    def __call__(self, key, fn, *, rtol: float = 0.0, atol: float = 0.0, recorded=None,
                 shared: bool = False):
        """jax's value for `key` of this test: `fn(jax)` when live (checked against the
        recording, bit for bit unless rtol/atol), else the recording. fn's parameters may
        instead name the modules it wants (`lambda jnp: jnp.sin(x)`: jax.numpy; see _call).
        `key` None: the call's number in this test (call jax_ref unconditionally then, so
        that both twins count alike). `recorded`: the recording
        itself, from a file of its own (tests/data/optax_vectors.npz ...), instead of the
        store's. `shared`: the key is the module's, not this test's (one recording for the
        parametrizations of a test that compare with the same jax value). A key asked for again
        in the same test gives the same value (fn not called)."""
        if key is None:   # the next of this test's calls (the same order in both twins)
            key = f"#{self._count}"
            self._count += 1
        key = str(key)
        prefix = SHARED if shared else self._prefix
        if (prefix, key) in self._seen:
            return self._seen[prefix, key]
        value = self._get(prefix, key, fn, rtol, atol, recorded)
        self._seen[prefix, key] = value
        return value

    def _get(self, prefix, key, fn, rtol, atol, recorded):
        import pytest
        where = f"{prefix!r} key {key!r} ({self.path})"
        if recorded is not None:
            if not self.live:
                return recorded
            value = to_numpy(self._call(fn))
            if not self._record:  # (its own generator rewrites that file)
                _same(recorded, value, rtol, atol, f"recorded {where} against live jax",
                      cross_cpu=not same_cpu(None))
            return value
        if not self.live:
            try:
                return self._store.get(self._module, prefix, key)
            except KeyError:
                pytest.fail(f"no recorded value for {where}: run `python tools/record_vectors.py` "
                            "(with the pinned jax)", pytrace=False)
        value = to_numpy(self._call(fn))
        if self._record:
            self._store.put(self._module, prefix, key, value)
            return value
        try:
            want = self._store.get(self._module, prefix, key)
        except KeyError:
            pytest.fail(f"no recorded value for {where} (the recorded twin of this test would "
                        "fail): run `python tools/record_vectors.py`", pytrace=False)
        _same(want, value, rtol, atol, f"recorded {where} against live jax",
              cross_cpu=not self.same_cpu)
        return value

    _MODULES = {"jax": "jax", "jnp": "jax.numpy", "lax": "jax.lax", "jlax": "jax.lax",
                "optax": "optax",
                "flax": "flax", "linen": "flax.linen", "fnn": "flax.linen",
                "fP": "flax.linen.partitioning"}

    def _call(self, fn):
        """fn(jax), or fn with the modules its parameters name (`lambda jnp: ...` gets
        jax.numpy; jax, jnp, lax / jlax, optax, flax, linen / fnn, fP: flax.linen.partitioning)."""
        import importlib
        import inspect
        try:
            names = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            names = ["jax"]
        if names and all(n in self._MODULES for n in names):
            return fn(**{n: importlib.import_module(self._MODULES[n]) for n in names})
        return fn(self.jax)

    @property
    def path(self):
        return os.path.relpath(self._store.path(self._module))


# --- which modules' recordings were checked against jax ------------------------------------
#
# A live twin recomputes jax's side of its test and checks the recording against it. With jax
# pinned, that can only find something when what jax is asked to compute changed since the
# recording was checked: the test module, or a helper module of tests/ that it imports. (A
# recording that no longer fits the test fails its recorded twin too, in the README's command,
# when ctrainstate's value moves with the new inputs.) CHECKED holds, per test module, the digest
# of those sources when all of its live twins last passed against the pinned jax
# (`tools/record_vectors.py`, which also records): CI's parity stage
# (`--live-twins=changed`) runs the live twins of the modules whose digest differs, and of
# every module when the installed jax / flax / optax are not the versions checked with.
CHECKED = os.path.join(DIR, "checked.json")
# the fixture's own machinery: how values are stored and compared, not what jax computes
_NOT_INPUTS = frozenset({"conftest", "recorded", "parity_marking"})


def _helper_imports(path: str, root: str) -> set[str]:
    """The helper modules that the module at `path` imports: those beside it (a test module
    of tests/nn/ importing another's inputs) and those of tests/ (root/<name>.py), looked up
    in that order, as pytest's sys.path finds them."""
    with open(path, "rb") as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names.update(a.name.split(".")[0] for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            names.add(n.module.split(".")[0])
    out = set()
    for m in names - _NOT_INPUTS:
        for d in (os.path.dirname(os.path.abspath(path)), root):
            if os.path.isfile(os.path.join(d, m + ".py")):
                out.add(os.path.join(d, m + ".py"))
                break
    return out


def source_digest(path: str, root: str | None = None) -> str:
    """sha256 of a test module's source and of the helper modules (beside it or of tests/:
    `root`, TESTS by default) that it imports, directly or through each other: what its live
    twins ask jax to compute. conftest.py, recorded.py and parity_marking.py are left out."""
    root = TESTS if root is None else root
    seen, todo = set(), [os.path.abspath(path)]
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.add(p)
            todo.extend(_helper_imports(p, root) - seen)
    h = hashlib.sha256()
    first = os.path.abspath(path)
    for p in [first] + sorted(seen - {first}):
        with open(p, "rb") as f:
            data = f.read()
        h.update(f"{os.path.relpath(p, root)}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def live_versions() -> dict:
    """The installed jax, flax and optax versions (not imported; None where missing)."""
    out = {}
    for m in ("jax", "flax", "optax"):
        try:
            out[m] = metadata.version(m)
        except metadata.PackageNotFoundError:
            out[m] = None
    return out


def read_checked(path: str | None = None) -> dict:
    """CHECKED's content: {"versions": {...}, "modules": {relpath: digest}} (empty if none)."""
    path = CHECKED if path is None else path
    if not os.path.exists(path):
        return {"versions": {}, "modules": {}}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if set(data) != {"versions", "modules"}:
        raise ValueError(f"{path}: expected the keys 'versions' and 'modules', got {sorted(data)}")
    return data


def unchanged_modules(modules, checked: dict, versions: dict, root: str | None = None) -> set:
    """Those of `modules` (paths of test modules) whose recordings were checked against these
    jax / flax / optax `versions` with their sources as they are now."""
    if not versions.get("jax") or checked["versions"] != versions:
        return set()
    root = TESTS if root is None else root
    return {p for p in modules
            if checked["modules"].get(os.path.relpath(p, root)) == source_digest(p, root)}


def stamp_checked(twins: dict, passed: set, versions: dict, path: str | None = None,
                  root: str | None = None) -> list[str]:
    """Record in CHECKED the modules all of whose live twins passed. `twins`: module path ->
    the node ids of its live twins (all of them, before any deselection); `passed`: the node ids
    that passed. Versions other than the ones stamped so far start the file afresh. Returns the
    modules stamped (paths relative to `root`)."""
    path = CHECKED if path is None else path
    root = TESTS if root is None else root
    done = sorted(p for p, ids in twins.items() if ids and set(ids) <= passed)
    if not done:
        return []
    if not versions.get("jax"):
        raise ValueError("recordings are checked against an installed jax")
    checked = read_checked(path)
    if checked["versions"] != versions:
        checked = {"versions": dict(versions), "modules": {}}
    for p in done:
        checked["modules"][os.path.relpath(p, root)] = source_digest(p, root)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(checked, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return [os.path.relpath(p, root) for p in done]


def versions() -> dict:
    """The installed jax, jaxlib, flax and optax versions (those that are imported), and the CPU
    model the recording is made on (see CROSS_CPU_ULPS)."""
    out = {"cpu": host_cpu()}
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
    large exact result as a short string). NaNs are replaced in the bits themselves, so the
    digest does not depend on the NaN numpy / ml_dtypes write."""
    a = np.asarray(a, order="C")
    head = f"{a.dtype.name}{a.shape}"
    if a.dtype.kind in "fV" or a.dtype.name == "bfloat16":
        nan = np.isnan(a.astype(np.float32))
        a = a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])
        if nan.any():
            a = a.copy()
            a[nan] = np.iinfo(a.dtype).max
    h = hashlib.sha256(head.encode())
    h.update(a.tobytes())
    return h.hexdigest()


def exact_record(a, every: int = 97) -> dict:
    """A large exact result recorded small: the digest of its bits (bits_digest) and every
    `every`-th element (for a readable failure). Compare with assert_exact."""
    a = np.asarray(a)
    return {"digest": bits_digest(a), "sample": a.reshape(-1)[::every].copy()}


def assert_exact(got, rec: dict, what: str = "", every: int = 97) -> None:
    """got has the dtype, shape and bits of the result recorded by exact_record (a NaN
    matches any NaN)."""
    got = np.asarray(got)
    if bits_digest(got) == rec["digest"]:
        return
    g, w = got.reshape(-1)[::every], np.asarray(rec["sample"])
    if g.dtype == w.dtype and g.shape == w.shape:
        bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[g.dtype.itemsize]
        same = g.view(bits) == w.view(bits)
        if g.dtype.kind == "f" or g.dtype.name == "bfloat16":
            same |= np.isnan(g.astype(np.float32)) & np.isnan(w.astype(np.float32))
        bad = np.flatnonzero(~same)
        if bad.size:
            raise AssertionError(f"{what}: differs from jax's recorded bits at flat indices "
                                 f"{(bad[:4] * every).tolist()}: got {g[bad[:4]]}, want {w[bad[:4]]}")
    raise AssertionError(f"{what}: differs from jax's recorded bits (dtype {got.dtype}, shape "
                         f"{got.shape}; not at any {every}th element)")
