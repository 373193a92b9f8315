"""Test configuration: 8 CPU virtual devices (and 8 XLA CPU devices for parity tests).

Both variables are read at first use, so they are set here before anything
imports ctrainstate or jax.
"""
import gc
import os
import subprocess
import sys

if os.environ.get("CTRAINSTATE_SANITIZED") != "1":
    # Import the package of this checkout (built in place), whatever other
    # checkout an editable install points at.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

os.environ.setdefault("CTRAINSTATE_NUM_CPU_DEVICES", "8")
_xla = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _xla:
    os.environ["XLA_FLAGS"] = (_xla + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# numpy's and scipy's OpenBLAS: one thread. The tests' numpy references are small arrays;
# after each BLAS call a threaded OpenBLAS keeps its idle threads spinning, which takes a
# core from the rest of the run (and from the other stage CI runs beside it). Read when numpy
# is first imported, below.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# Ctrl-C as Python's default: a run started with SIGINT ignored (a background job of a shell
# without job control, `(pytest ... &)`, inherits SIG_IGN, and so do the child interpreters
# the tests start) would otherwise never see the SIGINTs the interrupt tests send (test_array's
# and test_error_paths' children ran their minutes of work to the 120 s limit,
# test_train_state's Ctrl-C tests failed). Caught signals, unlike ignored ones, are reset to
# their default in a child at exec.
import signal  # noqa: E402

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _host_has_native_float16() -> bool:
    """Whether this CPU has AVX512-FP16 (float16 arithmetic in hardware)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512_fp16" in line.split()
    except OSError:
        pass
    return False


# The jax side of the float16 parity tests. The HLO of jax's float16 samplers rounds every
# multiply and add to float16, and ctrainstate does the same. XLA's CPU backend keeps that
# rounding where the CPU has no float16 arithmetic (it widens each op to float32 and narrows
# it back). On a CPU with AVX512-FP16 it emits float16 instructions instead, and LLVM fuses a
# multiply and the add after it into one float16 FMA with a single rounding. jax's float16
# uniform(minval, maxval), truncated_normal and the initializers built on them then differ by
# an ulp in the uniform step (measured on a Sapphire Rapids VM: 52913 of 100000 `a * c1 + c2`
# differ from the per-op rounding; tests/random/test_random.py's live parity failed there). Capping
# XLA at AVX2 restores the per-op rounding (measured: 0 differences), so the live parity tests
# compare against the same jax values on every host. It changes which vector instructions
# XLA picks, not the HLO: float32 results were the same in the full suite.
# An XLA that does not know the flag would abort at its first use, so a child process tries it
# first (about a second, on such hosts only; without jax it fails and nothing is added).
def _xla_accepts(flags: str) -> bool:
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    try:
        return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                              capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _cap_xla_isa() -> None:
    """On an AVX512-FP16 host, XLA capped at AVX2 (for the live parity tests only: called from
    pytest_configure when they may run, before anything imports jax)."""
    if _host_has_native_float16() and "xla_cpu_max_isa" not in os.environ["XLA_FLAGS"]:
        capped = os.environ["XLA_FLAGS"] + " --xla_cpu_max_isa=AVX2"
        if os.environ.get("CTRAINSTATE_SANITIZED") != "1" and _xla_accepts(capped):
            os.environ["XLA_FLAGS"] = capped


# jax's persistent compilation cache. The parity tests spend most of their time in XLA
# compiling the jax side; with the compiled programs kept on disk, a second pytest process (CI's
# rerun of the CPU suites on emulated GPU devices, a developer's rerun) loads them instead. The
# programs are the same, so are their results. CTRAINSTATE_TEST_JAX_CACHE: the directory, or
# 0 for none.
_jax_cache = os.environ.get("CTRAINSTATE_TEST_JAX_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
    "ctrainstate", "jax-test-compile")
if _jax_cache != "0":
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _jax_cache)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

if os.environ.get("CTRAINSTATE_SANITIZED") == "1":
    # Under tools/sanitize.sh: jaxlib is not built for ASan, so parity tests
    # (which only exercise jax's side) skip via pytest.importorskip.
    for _mod in ("jax", "flax", "optax", "torch"):
        sys.modules[_mod] = None

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import ctrainstate as cts  # noqa: E402


def _has_gpu():
    try:
        return len(cts._src.base.devices._ids("gpu")) > 0
    except Exception:
        return False


# --- live jax / flax / optax: the `parity` marker -------------------------------------------
#
# A test that uses jax, flax or optax live is marked `parity` here, never by hand: when it asks
# for one of the fixtures `jax`, `jnp`, `flax`, `optax` below, for the live side of `jax_ref`,
# or when tests/parity_marking.py finds that it imports them (directly, through a helper, or
# through names its module binds by importing them). The README's test command
# (`python -m pytest -x -q tests`) deselects those tests (as `-m "not parity"`) and blocks the
# import of jax, flax and optax: a test that tries one anyway fails, so the marking cannot miss
# a test silently, and the run compiles no jax program. `-m parity` runs only the live tests
# (CI's parity stage), `--parity` runs everything; so does naming tests by node id
# (`tests/<layer>/test_x.py::test_y`), and any other `-m` expression is taken as given (jax not blocked).
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_marking  # noqa: E402
import recorded as _recorded  # noqa: E402

LIVE_FIXTURES = frozenset({"jax", "jnp", "flax", "optax"})
_analyzer = parity_marking.Analyzer()


class _LiveImportGuard:
    """A sys.meta_path finder that refuses jax, jaxlib, flax and optax (as if not installed:
    ModuleNotFoundError) and notes which test asked."""

    def __init__(self):
        self.current = None       # the node id of the running test (None while collecting)
        self.attempts = {}        # node id -> modules it tried

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in parity_marking.LIVE_ROOTS:
            self.attempts.setdefault(self.current, []).append(fullname)
            raise ModuleNotFoundError(
                f"No module named {fullname!r} (blocked: the README's test command runs without "
                "jax; `python -m pytest -m parity tests` runs the live parity tests)", name=fullname)
        return None


_guard = None
_wholly_live_modules = set()
_twin_passed: dict[str, bool] = {}   # live twin node id -> no phase of it failed or skipped


def pytest_addoption(parser):
    g = parser.getgroup("ctrainstate")
    g.addoption("--parity", action="store_true", default=False,
                help="also run the live jax/flax/optax parity tests (deselected by default, with "
                     "jax not imported; `-m parity` runs only them)")
    g.addoption("--shard", default=None, metavar="I/N",
                help="the I-th (0-based) of N parts of the tests selected, whole modules each, "
                     "of about equal numbers of tests (CI runs the parity tests in two)")
    g.addoption("--record-vectors", action="store_true", default=False,
                help="store the live values that `jax_ref` tests compare against in "
                     "tests/data/recorded/ (tools/record_vectors.py)")
    g.addoption("--live-twins", choices=("all", "changed"), default="all",
                help="the live twins of `jax_ref` tests to run: all, or (CI) only those of the "
                     "modules changed since their recordings were last checked against the "
                     "installed jax (tests/data/recorded/checked.json)")
    g.addoption("--stamp-recordings", action="store_true", default=False,
                help="run only the live twins of `jax_ref` tests and note in "
                     "tests/data/recorded/checked.json each module whose twins all passed "
                     "(tools/record_vectors.py)")


def _live_allowed(config) -> bool:
    """Whether this run may use jax (decided once, in pytest_configure)."""
    live = getattr(config, "_ctrainstate_live", None)
    if live is None:
        live = config._ctrainstate_live = bool(
            config.getoption("--parity") or config.getoption("--record-vectors")
            or config.getoption("--stamp-recordings") or config.option.markexpr
            or any("::" in str(a) for a in config.args))
    return live


def pytest_configure(config):
    global _guard
    if config.getoption("--shard"):
        i, n = (int(v) for v in config.getoption("--shard").split("/"))
        config.pluginmanager.register(_Shard(i, n), "ctrainstate-shard")
    if _live_allowed(config):
        _cap_xla_isa()
        return
    config.option.markexpr = "not parity"
    if os.environ.get("CTRAINSTATE_SANITIZED") != "1":  # there sys.modules already blocks them
        _guard = _LiveImportGuard()
        sys.meta_path.insert(0, _guard)


def pytest_unconfigure(config):
    global _guard
    if _guard is not None and _guard in sys.meta_path:
        sys.meta_path.remove(_guard)
    _guard = None


def pytest_report_header(config):
    if _live_allowed(config):
        return "live jax/flax/optax parity tests: as selected"
    return ("live jax/flax/optax parity tests: deselected, jax not imported "
            "(`-m parity` runs them, `--parity` runs everything)")


def pytest_ignore_collect(collection_path, config):
    # a module that cannot be imported without jax, when jax is blocked: not collected at all
    # (its tests are all live parity tests)
    if (_live_allowed(config) or collection_path.suffix != ".py"
            or not collection_path.name.startswith("test_")):
        return None
    info = _analyzer.info(str(collection_path))
    if info is not None and info.whole:
        _wholly_live_modules.add(collection_path.name)
        return True
    return None


def uses_jax_live(item) -> bool:
    """Whether the test item uses jax, flax or optax live (see the comment above)."""
    if item.get_closest_marker("parity") is not None:
        return True
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("jax_ref") == "recorded":
        return False  # the recorded twin: it must run without jax (else the guard fails it)
    names = set(getattr(item, "fixturenames", ()))
    if names & LIVE_FIXTURES:
        return True
    fn = getattr(item, "originalname", None)
    path = getattr(item, "path", None)
    if fn is None or path is None:
        return False
    info = _analyzer.info(str(path))
    if info is None:
        return False
    cls = item.cls.__name__ if getattr(item, "cls", None) is not None else None
    return info.uses_jax(fn, cls) or bool(names & info.tainted)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("parity") is None and uses_jax_live(item):
            item.add_marker(pytest.mark.parity)
    twins: dict[str, list] = {}   # module path -> its live twins
    for i in items:
        if _is_live_twin(i):
            twins.setdefault(str(i.path), []).append(i)
    config._ctrainstate_twins = {p: {i.nodeid for i in its} for p, its in twins.items()}
    drop = []
    if config.getoption("--record-vectors") or config.getoption("--stamp-recordings"):
        drop = [i for i in items if not _is_live_twin(i)]  # only the live twins record / check
    if config.getoption("--live-twins") == "changed":
        same = _recorded.unchanged_modules(twins, _recorded.read_checked(),
                                           _recorded.live_versions())
        skipped = [i for p in sorted(same) for i in twins[p]]
        config._ctrainstate_unchanged = (len(same), len(twins), len(skipped))
        drop += skipped
    if drop:
        gone = {id(i) for i in drop}
        config.hook.pytest_deselected(items=drop)
        items[:] = [i for i in items if id(i) not in gone]
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    # What collection leaves alive (the test modules, their parsed ASTs in parity_marking's
    # caches, the recordings' indexes: about a million objects) lives to the end of the session.
    # Frozen, it is left out of every later garbage collection: a full gc.collect() took 0.7 s
    # with it, and the suite runs one in each test that asks for `mem_baseline` and in pytest's
    # unraisable-exception check at the end.
    gc.collect()
    gc.freeze()


def _is_live_twin(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("jax_ref") == "live"


class _Shard:
    """--shard I/N (a plugin of its own: its hook runs after `-m` has deselected)."""

    def __init__(self, i, n):
        self.i, self.n = i, n

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        _shard(config, items, self.i, self.n)


def _shard(config, items, i, n):
    # whole modules (their tests share jax's compiled programs), the largest first, each to
    # the shard with the fewest tests so far: shards of about equal size
    sizes = {}
    for it in items:
        sizes[str(it.path)] = sizes.get(str(it.path), 0) + 1
    load, mine = [0] * n, set()
    for path in sorted(sizes, key=lambda p: (-sizes[p], p)):
        k = load.index(min(load))
        load[k] += sizes[path]
        if k == i:
            mine.add(path)
    drop = [it for it in items if str(it.path) not in mine]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [it for it in items if str(it.path) in mine]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _guard is not None:
        _guard.current = item.nodeid
    try:
        yield
    finally:
        if _guard is not None:
            _guard.current = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if _is_live_twin(item):   # (for --stamp-recordings: a twin passed if no phase failed)
        rep = outcome.get_result()
        if rep.failed or rep.skipped:
            _twin_passed[item.nodeid] = False
        elif rep.when == "call":
            _twin_passed.setdefault(item.nodeid, True)
    if _guard is None:
        return
    tried = _guard.attempts.pop(item.nodeid, None)
    if tried and item.get_closest_marker("parity") is None:
        rep = outcome.get_result()
        rep.outcome = "failed"
        rep.longrepr = (
            f"{item.nodeid} imports {', '.join(sorted(set(tried)))} but is not marked `parity`: "
            "ask for conftest's `jax`/`jnp`/`flax`/`optax` fixture (or `jax_ref`), or see why "
            "tests/parity_marking.py does not see its use of jax")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    unchanged = getattr(config, "_ctrainstate_unchanged", None)
    if unchanged is not None:
        same, modules, n = unchanged
        terminalreporter.write_line(
            f"live twins: {n} deselected ({same} of the {modules} modules that have them are "
            f"unchanged since their recordings were checked against jax "
            f"{_recorded.live_versions()['jax']}: tests/data/recorded/checked.json; "
            "`--live-twins=all` runs them)")
    if _live_allowed(config):
        return
    n = len(terminalreporter.stats.get("deselected", ()))
    extra = (f" and {len(_wholly_live_modules)} modules ({', '.join(sorted(_wholly_live_modules))})"
             if _wholly_live_modules else "")
    terminalreporter.write_line(
        f"live jax/flax/optax parity tests: {n} deselected{extra}; jax not imported "
        "(`python -m pytest -m parity tests` runs them)")


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if config.getoption("--record-vectors"):
        written = _store.write(_recorded.versions())
        tr = config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            for p in written:
                tr.ensure_newline()
                tr.write_line(f"recorded: {os.path.relpath(p)}")
    if config.getoption("--stamp-recordings"):
        twins = getattr(config, "_ctrainstate_twins", {})   # (none if collection failed)
        stamped = _recorded.stamp_checked(twins, {k for k, v in _twin_passed.items() if v},
                                          _recorded.live_versions())
        tr = config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.ensure_newline()
            tr.write_line(f"recordings checked against jax: {len(stamped)} of {len(twins)} "
                          f"modules noted in {os.path.relpath(_recorded.CHECKED)}")
    if _live_allowed(config) or os.environ.get("CTRAINSTATE_SANITIZED") == "1":
        return
    leaked = sorted(m for m in parity_marking.LIVE_ROOTS if sys.modules.get(m) is not None)
    if leaked:  # the guard was bypassed (a module put into sys.modules by hand, ...)
        tr = config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line(f"ERROR: {', '.join(leaked)} imported in a run without live parity")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# --- fixtures for live jax ------------------------------------------------------------------

@pytest.fixture
def jax():
    """jax (the test is marked `parity`; it skips without jax)."""
    return pytest.importorskip("jax")


@pytest.fixture
def jnp(jax):
    """jax.numpy (the test is marked `parity`)."""
    return pytest.importorskip("jax.numpy")


@pytest.fixture
def flax():
    """flax (the test is marked `parity`)."""
    return pytest.importorskip("flax")


@pytest.fixture
def optax():
    """optax (the test is marked `parity`)."""
    pytest.importorskip("jax")
    return pytest.importorskip("optax")


_store = _recorded.Store()


def _test_key(node) -> str:
    """The test's name without jax_ref's parameter: its twins share their recordings."""
    name = node.name
    for a, b in (("[live]", ""), ("[recorded]", ""), ("-live]", "]"), ("-recorded]", "]"),
                 ("[live-", "["), ("[recorded-", "["), ("-live-", "-"), ("-recorded-", "-")):
        name = name.replace(a, b)
    return name


@pytest.fixture
def twin_seed(request) -> int:
    """A seed of this test's own (the same in its recorded and live twins, whatever ran
    before): for a module whose tests draw inputs from a shared generator."""
    import zlib
    return zlib.crc32(_test_key(request.node).encode())


@pytest.fixture(params=["recorded", pytest.param("live", marks=pytest.mark.parity)])
def jax_ref(request):
    """jax's values for a comparison: `jax_ref(key, lambda jax: <jax computes it>)`. The test runs
    twice: `[recorded]` against tests/data/recorded/<module>.npz (no jax), `[live]` (marked
    `parity`) against jax itself, checking the recording too."""
    module = os.path.splitext(os.path.basename(str(request.node.path)))[0]
    live = request.param == "live"
    return _recorded.JaxRef(_store, module, _test_key(request.node), live,
                            request.config.getoption("--record-vectors"),
                            pytest.importorskip("jax") if live else None)


@pytest.fixture
def mem_baseline():
    """Per-device bytes_in_use before the test; the test can assert a return to it."""
    gc.collect()
    return [d.memory_stats()["bytes_in_use"] for d in cts.devices()]


def bytes_in_use():
    return [d.memory_stats()["bytes_in_use"] for d in cts.devices()]


def run_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter (for settings read at first use)."""
    e = dict(os.environ)
    for k in ("CTRAINSTATE_NUM_CPU_DEVICES", "CTRAINSTATE_CPU_DEVICE_MEMORY"):
        e.pop(k, None)
    if os.environ.get("CTRAINSTATE_SANITIZED") != "1":
        # the package of this checkout, as in this process (under tools/sanitize.sh,
        # PYTHONPATH already names the sanitized build)
        here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")
        e["PYTHONPATH"] = os.pathsep.join([here] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e,
                          timeout=120)


def flat_tree(tree, prefix=""):
    """A nested dict as {'a/b/c': leaf} (params and gradients in tests)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat_tree(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = v
    return out


def without_host_copies(monkeypatch, run):
    """``run()`` twice: once to make the device constants it keeps (the device gathers' cache
    emptied first, so that none of the warm-up's is evicted before the second run), then with
    every copy to or from the host refused (an AssertionError); the second run's result."""
    from ctrainstate import _C
    from ctrainstate._src.ops import slicing
    slicing._KEPT.clear()
    run()

    def refuse(*args):
        raise AssertionError("a block went through the host")
    with monkeypatch.context() as mp:
        for name in ("copy_to_host", "copy_from_host"):
            mp.setattr(_C, name, refuse)
        return run()


def on_gpu(*arrays) -> bool:
    """Whether any of these ctrainstate Arrays has a shard on a GPU device."""
    return any(d.platform != "cpu" for a in arrays for d in a.devices())


def assert_same_bits(got, want, gpu: bool, err_msg: str = "") -> None:
    """got and want (numpy arrays of one dtype and shape) hold the same bits. With ``gpu``
    (got was computed on GPU devices: see :func:`on_gpu`), a NaN matches any NaN: CUDA's
    arithmetic returns the canonical NaN 0x7fffffff (float16 0x7fff, bfloat16 0x7fff),
    keeping neither the sign nor the payload, where x86 and XLA's CPU return 0xffc00000 for
    an invalid operation and keep an input NaN's bits; jax on GPU does the same as CUDA.
    Every other element, and every element on CPUs (the jax-parity claim), must match
    bit for bit."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype, err_msg)
    assert got.shape == want.shape, (got.shape, want.shape, err_msg)
    got, want = got.reshape(-1), want.reshape(-1)
    if gpu and (got.dtype.kind == "f" or got.dtype.name == "bfloat16"):
        gn, wn = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
        np.testing.assert_array_equal(gn, wn, err_msg=f"{err_msg} (NaN positions)")
        got, want = got[~gn], want[~wn]
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=err_msg)
