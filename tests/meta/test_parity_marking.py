"""The `parity` marker is applied by tests/conftest.py and tests/parity_marking.py, not by hand:
the analysis on each way a test can use jax, a sample of the suite's own live tests, and the
README's test command's guard (in a child pytest on a scratch copy of the test configuration).
"""
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import parity_marking

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
ROOT = os.path.dirname(HERE)


def _module_path(name: str) -> str:
    """tests/<layer>/<name>: the test module of that file name, whatever its layer."""
    found = [os.path.join(d, name) for d, _, files in os.walk(HERE) if name in files]
    return found[0] if len(found) == 1 else os.path.join(HERE, name)


def _info(tmp_path, src, name="test_mod.py", helpers=None):
    for hname, hsrc in (helpers or {}).items():
        (tmp_path / hname).write_text(textwrap.dedent(hsrc))
    p = tmp_path / name
    p.write_text(textwrap.dedent(src))
    return parity_marking.Analyzer().info(str(p))


def test_each_way_of_using_jax_is_seen(tmp_path):
    info = _info(tmp_path, '''
        import numpy as np
        import pytest
        import helper_mod as hm
        from helper_mod import run_live, plain
        try:
            import optax
            HAVE_OPTAX = True
        except ImportError:
            HAVE_OPTAX = False

        def _jax():
            return pytest.importorskip("jax.numpy")

        def _via_helper():
            return _jax().ones(3)

        def test_importorskip():
            jax = pytest.importorskip("jax")

        def test_import_in_body():
            from flax import linen

        def test_helper():
            _via_helper()

        @pytest.mark.skipif(not HAVE_OPTAX, reason="no optax")
        def test_flag_in_decorator():
            pass

        def test_module_name():
            optax.adam(1.0)

        def test_other_module_function():
            run_live()

        def test_other_module_attribute():
            hm.run_live()

        def test_import_module():
            import importlib
            importlib.import_module("optax")

        def test_jax_ref_argument_only(jax_ref):
            jax_ref("k", lambda jax: _jax().ones(3))

        def test_numpy_only():
            np.ones(3)
            plain()

        def test_a_local_of_the_same_name():
            import numpy as optax   # a local: not the module-level optax
            optax.ones(3)

        def test_a_parameter_of_the_same_name(optax=None):
            return optax

        class TestGroup:
            def _live(self):
                return pytest.importorskip("jax")

            def test_calls_live_method(self):
                self._live()

            def test_plain(self):
                pass
        ''', helpers={"helper_mod.py": '''
        def run_live():
            import jax
            return jax

        def plain():
            return 1
        '''})
    live = ["test_importorskip", "test_import_in_body", "test_helper", "test_flag_in_decorator",
            "test_module_name", "test_other_module_function", "test_other_module_attribute",
            "test_import_module"]
    for name in live:
        assert info.uses_jax(name), name
    for name in ("test_numpy_only", "test_jax_ref_argument_only", "test_a_local_of_the_same_name",
                 "test_a_parameter_of_the_same_name"):
        assert not info.uses_jax(name), name
    assert info.uses_jax("test_calls_live_method", "TestGroup")
    assert not info.uses_jax("test_plain", "TestGroup")
    assert not info.whole


@pytest.mark.parametrize("src", [
    "import jax\ndef test_a():\n    pass\n",
    "import pytest\nflax = pytest.importorskip('flax')\ndef test_a():\n    pass\n",
    "import pytest\ntry:\n    import jax\nexcept ImportError:\n    jax = None\n"
    "pytestmark = pytest.mark.skipif(jax is None, reason='no jax')\ndef test_a():\n    pass\n",
])
def test_a_module_that_needs_jax_is_live_as_a_whole(tmp_path, src):
    info = _info(tmp_path, src)
    assert info.whole and info.uses_jax("test_a")


# tests of the suite that use jax in the different ways above and have no recorded twin: the
# analysis must call each of them live, and the numpy-only neighbours not
_SUITE_LIVE = [
    ("test_random_discrete.py", "test_live_parity_key_helpers"),   # importorskip in the body
    ("test_activation.py", "test_activations_match_jax"),          # a module-level helper
    ("test_hf_train_state.py", "test_onehot_matches_flax"),        # importorskip of flax.*
]
_SUITE_PLAIN = [
    ("test_random_dist.py", "test_rademacher_signs"),
    ("test_optim_transforms.py", "test_transforms_without_jax_hand_computed"),
    ("test_array.py", "test_replicas_are_separate_buffers"),
    # `import ctrainstate.numpy as jnp` inside: a local, not the module's jax.numpy
    ("test_numpy_more.py", "test_jnp_ndarray_is_the_array_type"),
    # flax only inside jax_ref's function: the fixture marks the live twin
    ("test_attention_flax.py", "test_mha_init_params_match_flax"),
    ("test_linen.py", "test_einsum_matches_flax"),
]


@pytest.mark.parametrize("module,test", _SUITE_LIVE + _SUITE_PLAIN)
def test_the_suites_live_tests_are_seen(module, test):
    path = _module_path(module)
    src = open(path, encoding="utf-8").read()
    if not re.search(rf"^def {test}\(", src, re.M):
        pytest.fail(f"{module}::{test} is gone: pick another sample for this test")
    want = (module, test) in _SUITE_LIVE
    assert parity_marking.Analyzer().info(path).uses_jax(test) is want


_PROBE = '''
import importlib
import sys

import numpy as np
import pytest

try:
    import optax
except ImportError:
    optax = None


def test_numpy_only():
    assert np.ones(3).sum() == 3


def test_uses_the_jax_fixture(jax):
    assert jax.numpy.ones(3).sum() == 3


def test_uses_a_module_level_import():
    assert optax is not None


def test_hides_its_import():
    pytest.importorskip("ja" + "x")   # the analysis cannot see this name: the guard does


def test_jax_ref_twins(jax_ref):
    got = np.arange(3, dtype=np.float32) * 2
    want = jax_ref("double", lambda jax: jax.numpy.arange(3, dtype="float32") * 2)
    np.testing.assert_array_equal(got, want)


def test_z_no_jax_was_imported():
    assert "jax" not in sys.modules and "optax" not in sys.modules
'''


def _probe(tmp_path, *args, source=_PROBE):
    for f in ("conftest.py", "parity_marking.py", "recorded.py"):
        shutil.copy(os.path.join(HERE, f), tmp_path / f)
    (tmp_path / "test_probe.py").write_text(source)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(ROOT, "python")] + ([os.environ["PYTHONPATH"]] if "PYTHONPATH" in os.environ
                                         else [])))
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("CTRAINSTATE_SANITIZED", None)  # the guard, not tools/sanitize.sh's blocking
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-o", "addopts=", "--rootdir", str(tmp_path), *args, "test_probe.py"],
                       cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    return r.stdout + r.stderr


def test_the_readme_command_deselects_live_tests_and_fails_hidden_jax(tmp_path):
    # the recorded twin of test_jax_ref_twins reads its value from data/recorded/test_probe.npz
    rec = tmp_path / "data" / "recorded"
    rec.mkdir(parents=True)
    import recorded
    store = recorded.Store()
    store.put("test_probe", "test_jax_ref_twins", "double",
              __import__("numpy").arange(3, dtype="float32") * 2)
    recorded.DIR, old = str(rec), recorded.DIR
    try:
        store.write({"jax": "probe"})
    finally:
        recorded.DIR = old
    out = _probe(tmp_path, "-rf")
    # deselected: the fixture user, the module-level-import user, the live twin
    assert re.search(r"\b1 failed, 3 passed, 3 deselected\b", out), out
    assert "FAILED test_probe.py::test_hides_its_import" in out, out
    assert "imports jax but is not marked `parity`" in out, out


def test_minus_m_parity_selects_exactly_the_live_tests(tmp_path):
    out = _probe(tmp_path, "-m", "parity", "--collect-only")
    got = sorted(re.findall(r"test_probe.py::(\S+)", out))
    assert got == ["test_jax_ref_twins[live]", "test_uses_a_module_level_import",
                   "test_uses_the_jax_fixture"], out


# --- the recordings -----------------------------------------------------------------------

def _pins():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "record_vectors", os.path.join(ROOT, "tools", "record_vectors.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.pins()


def test_recordings_are_of_the_pinned_versions():
    """Every recording was made with the jax / flax / optax that .ci/run pins (the versions
    its live twins compare with in CI): tools/record_vectors.py refuses others."""
    import numpy as np
    import recorded
    pins = _pins()
    pins_of = {"jax": pins["jax"], "jaxlib": pins["jax"], "flax": pins["flax"],
               "optax": pins["optax"]}
    files = sorted(f for f in os.listdir(recorded.DIR) if f.endswith(".npz"))
    assert files
    for f in files:
        meta = recorded.read_meta(os.path.join(recorded.DIR, f))
        assert meta.get("jax") == pins["jax"], (f, meta)
        for k, v in meta.items():
            if k == "cpu":   # the CPU model it was made on (recorded.CROSS_CPU_ULPS)
                assert isinstance(v, str) and len(v.split()) == 3, (f, v)
                continue
            assert v == pins_of[k], (f, k, v, pins)
    with np.load(os.path.join(HERE, "data", "optax_vectors.npz")) as z:
        assert str(z["meta/optax_version"]) == pins["optax"]
    with open(os.path.join(HERE, "data", "random_vectors.txt")) as fh:
        assert fh.readline().split()[-1] == pins["jax"]


def test_every_recording_belongs_to_a_test():
    """A recording whose test module or test is gone (renamed, removed) is stale: rerun
    tools/record_vectors.py (it rewrites the modules it records) or delete it."""
    import numpy as np
    import recorded
    for f in sorted(os.listdir(recorded.DIR)):
        if not f.endswith(".npz"):
            continue
        path = _module_path(f[:-4] + ".py")
        assert os.path.exists(path), f"{f}: no tests/<layer>/{f[:-4]}.py"
        src = open(path, encoding="utf-8").read()
        with np.load(os.path.join(recorded.DIR, f)) as z:
            tests = {k.split("[")[0] for k in z.files
                     if k not in (recorded.META, recorded.SHARED) and not k.endswith("#")}
        for t in tests:
            assert re.search(rf"^def {re.escape(t)}\(", src, re.M), f"{f}: no test {t}"


def test_recording_check_across_cpu_models():
    """recorded._same: bit for bit on the recording's CPU model; on another model, float leaves
    within CROSS_CPU_ULPS ulps of each value or of the leaf's largest magnitude, and nothing
    else; which model made a recording ("cpu" in its __meta__, the vendor for older ones)."""
    import numpy as np
    import recorded
    n = recorded.CROSS_CPU_ULPS
    x = np.float32([1.0, -2.5, 3e-3, 0.0, np.nan])
    up = x.copy()
    up[:3] = [np.float32(v) for v in (1.0 + n * 2.0 ** -23, -2.5 - n * 2.0 ** -22,
                                       np.nextafter(np.float32(3e-3), np.float32(1)))]
    assert list(recorded.ulps_apart(x[:4], up[:4])) == [n, n, 1, 0]
    recorded._same(x, x.copy(), 0, 0, "w")                    # the bits
    with pytest.raises(AssertionError, match="bits"):
        recorded._same(x, up, 0, 0, "w")                      # same model: one ulp is too many
    recorded._same({"a": x, "b": [np.int32(3)]}, {"a": up, "b": [np.int32(3)]}, 0, 0, "w",
                   cross_cpu=True)
    far = up.copy()
    far[1] = np.nextafter(far[1], np.float32(-9))             # n + 1 ulps of -2.5
    with pytest.raises(AssertionError, match=r"recorded np.float32\(-2.5\)"):
        recorded._same(x, far, 0, 0, "w", cross_cpu=True)
    # a value cancelled toward zero: ulps of the leaf's largest magnitude (3.0)
    small = np.float32([3.0, 1e-7])
    near = np.float32([3.0, 1e-7 + 8 * np.spacing(np.float32(3.0))])
    recorded._same(small, near, 0, 0, "w", cross_cpu=True)
    with pytest.raises(AssertionError, match="bits"):
        recorded._same(small, near, 0, 0, "w")
    for other in (np.int32([1, 3]), np.float32([1.0, np.nan])):   # integers, NaN: exact
        with pytest.raises(AssertionError):
            recorded._same(np.int32([1, 2]) if other.dtype.kind == "i" else np.float32([1, 2]),
                           other, 0, 0, "w", cross_cpu=True)
    host = "GenuineIntel 6 207"
    assert recorded.same_cpu(host, host) and not recorded.same_cpu("AuthenticAMD 25 17", host)
    assert recorded.same_cpu(None, "AuthenticAMD 25 17")      # no model kept: the vendor
    assert not recorded.same_cpu(None, host) and not recorded.same_cpu(host, "")


# --- which modules' recordings were checked (recorded.CHECKED, --live-twins=changed) ---------

def test_source_digest_covers_the_module_and_the_helpers_it_imports(tmp_path):
    """A module's digest changes with its source and with a helper that it imports, directly
    or through another helper: one of tests/ or one beside it (tests/nn/test_attention.py's
    inputs, which tests/nn/test_attention_flax.py imports). It does not change with
    conftest.py / recorded.py (the fixture's machinery) or with a helper it does not import."""
    import recorded
    files = {"sub/test_a.py": "import helper\nfrom sibling import s\nfrom conftest import x\n"
                              "\ndef test_a(): pass\n",
             "sub/sibling.py": "from helper3 import g\ns = 1\n", "helper.py": "from helper2 import f\n",
             "helper2.py": "def f(): return 1\n", "helper3.py": "def g(): return 2\n",
             "sibling.py": "s = 2\n",      # hidden by sub/sibling.py, which pytest finds first
             "unused.py": "y = 1\n", "sub/unused2.py": "y = 2\n", "conftest.py": "x = 1\n",
             "recorded.py": "z = 1\n"}
    (tmp_path / "sub").mkdir()
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    mod = str(tmp_path / "sub" / "test_a.py")
    base = recorded.source_digest(mod, str(tmp_path))
    assert base == recorded.source_digest(mod, str(tmp_path))
    for name, moves in (("conftest.py", False), ("recorded.py", False), ("unused.py", False),
                        ("sub/unused2.py", False), ("sibling.py", False), ("helper2.py", True),
                        ("helper.py", True), ("sub/sibling.py", True), ("helper3.py", True),
                        ("sub/test_a.py", True)):
        (tmp_path / name).write_text(files[name] + "# edited\n")
        assert (recorded.source_digest(mod, str(tmp_path)) != base) is moves, name
        (tmp_path / name).write_text(files[name])
        assert recorded.source_digest(mod, str(tmp_path)) == base


def test_stamps_note_only_modules_whose_twins_all_passed(tmp_path):
    import recorded
    for name in ("test_a.py", "test_b.py"):
        (tmp_path / name).write_text(f"def test(): pass  # {name}\n")
    a, b = str(tmp_path / "test_a.py"), str(tmp_path / "test_b.py")
    path, root = str(tmp_path / "checked.json"), str(tmp_path)
    v1 = {"jax": "1.0", "flax": "2.0", "optax": "3.0"}
    twins = {a: {"a::t[live]", "a::u[live]"}, b: {"b::t[live]"}}
    assert recorded.read_checked(path) == {"versions": {}, "modules": {}}
    assert recorded.stamp_checked(twins, {"a::t[live]"}, v1, path, root) == []   # none whole
    assert not os.path.exists(path)
    assert recorded.stamp_checked(twins, {"a::t[live]", "a::u[live]", "b::x"}, v1, path,
                                  root) == ["test_a.py"]
    checked = recorded.read_checked(path)
    assert checked == {"versions": v1,
                       "modules": {"test_a.py": recorded.source_digest(a, root)}}
    assert recorded.unchanged_modules([a, b], checked, v1, root) == {a}
    assert recorded.unchanged_modules([a, b], checked, dict(v1, jax="1.1"), root) == set()
    assert recorded.unchanged_modules([a, b], checked, dict(v1, jax=None), root) == set()
    # b's twin passes later: a keeps its note
    assert recorded.stamp_checked(twins, {"b::t[live]"}, v1, path, root) == ["test_b.py"]
    assert recorded.unchanged_modules([a, b], recorded.read_checked(path), v1, root) == {a, b}
    (tmp_path / "test_a.py").write_text("def test(): pass  # changed\n")
    assert recorded.unchanged_modules([a, b], recorded.read_checked(path), v1, root) == {b}
    # other versions start the notes afresh
    v2 = dict(v1, optax="3.1")
    assert recorded.stamp_checked(twins, {"a::t[live]", "a::u[live]"}, v2, path, root) == \
        ["test_a.py"]
    assert set(recorded.read_checked(path)["modules"]) == {"test_a.py"}
    with pytest.raises(ValueError, match="installed jax"):
        recorded.stamp_checked(twins, {"b::t[live]"}, dict(v1, jax=None), path, root)
    # without jax the twins skip: nothing passed, nothing to note, no error
    assert recorded.stamp_checked(twins, set(), dict(v1, jax=None), path, root) == []
    (tmp_path / "bad.json").write_text('{"modules": {}}')
    with pytest.raises(ValueError, match="'versions' and 'modules'"):
        recorded.read_checked(str(tmp_path / "bad.json"))


def test_live_twins_changed_leaves_out_the_twins_of_checked_modules(tmp_path):
    """`-m parity --live-twins=changed` (CI's parity stage) deselects the live twins of a
    module noted as checked with its current sources and the installed jax; the other live
    tests stay, and so do the twins once the module changes. Without jax installed nothing is
    noted as checked, so every twin stays."""
    import json
    import recorded
    (tmp_path / "data" / "recorded").mkdir(parents=True)
    (tmp_path / "test_probe.py").write_text(_PROBE)
    versions = recorded.live_versions()
    note = {"versions": versions, "modules": {
        "test_probe.py": recorded.source_digest(str(tmp_path / "test_probe.py"), str(tmp_path))}}
    (tmp_path / "data" / "recorded" / "checked.json").write_text(json.dumps(note))
    out = _probe(tmp_path, "-m", "parity", "--live-twins=changed", "--collect-only")
    got = sorted(re.findall(r"test_probe.py::(\S+)", out))
    if versions["jax"] is None:
        assert "test_jax_ref_twins[live]" in got and "live twins: 0 deselected" in out, out
    else:
        assert got == ["test_uses_a_module_level_import", "test_uses_the_jax_fixture"], out
        assert "live twins: 1 deselected (1 of the 1 modules" in out, out
    out = _probe(tmp_path, "-m", "parity", "--live-twins=changed", "--collect-only",
                 source=_PROBE + "\n# a change\n")
    assert "test_jax_ref_twins[live]" in out and "live twins: 0 deselected" in out, out


def test_the_checked_notes_are_of_the_pins_and_name_test_modules():
    """tests/data/recorded/checked.json (written by tools/record_vectors.py): the versions
    .ci/run pins, and modules of tests/ that have live twins."""
    import recorded
    checked = recorded.read_checked()
    assert checked["modules"], "no module noted: run `python tools/record_vectors.py --check`"
    pins = _pins()
    assert checked["versions"] == {k: pins[k] for k in ("jax", "flax", "optax")}
    for rel, digest in checked["modules"].items():
        path = os.path.join(HERE, rel)
        assert os.path.isfile(path), f"{rel}: no such test module"
        assert "jax_ref" in open(path, encoding="utf-8").read(), rel
        assert re.fullmatch(r"[0-9a-f]{64}", digest), (rel, digest)
