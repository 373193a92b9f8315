"""Record jax/flax/optax's values for the tests that compare against them, with the pinned jax.

    python tools/record_vectors.py            # every recording (the pins of .ci/run required)
    python tools/record_vectors.py -k random  # only the jax_ref tests that -k selects
    python tools/record_vectors.py --no-legacy  # skip the older generators in tests/data
    python tools/record_vectors.py --check      # record nothing: check the recordings, note them

The README's test command runs without jax: a test that compares with jax through the
`jax_ref` fixture (tests/conftest.py, tests/recorded.py) reads jax's values from
tests/data/recorded/<test module>.npz there, and its live twin (marked `parity`) checks those
recordings against jax itself. This script runs the live twins with `--record-vectors`, which
stores what jax computes instead of comparing, then (unless --no-legacy) the generators of the
older recordings: tests/data/gen_optax_vectors.py (optax_vectors.npz),
make_flax_module_vectors.py (flax_module_vectors.npz) and make_random_vectors.py
(random_vectors.txt, also read by the C tests). Then it runs the live twins again, against
the recordings, with `--stamp-recordings`: tests/data/recorded/checked.json notes each test
module whose twins all passed, with the digest of its sources. CI's parity stage runs the live
twins of the modules whose sources changed since (`--live-twins=changed`), so commit that
file with the recordings. Recordings hold the versions they were made with;
tests/meta/test_parity_marking.py checks that they are the pins.
"""
import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pins() -> dict:
    """The jax, flax and optax versions .ci/run installs."""
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        text = f.read()
    out = {}
    for name, pat in (("jax", r"'jax\[cpu\]==([^']+)'"), ("flax", r"'flax==([^']+)'"),
                      ("optax", r"'optax==([^']+)'")):
        m = re.search(pat, text)
        if m is None:
            raise SystemExit(f".ci/run pins no {name} version")
        out[name] = m.group(1)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default=None, help="pytest -k expression (the jax_ref tests to record)")
    ap.add_argument("--no-legacy", action="store_true", help="skip tests/data's older generators")
    ap.add_argument("--any-version", action="store_true",
                    help="record with whatever jax is installed (the pin check then fails)")
    ap.add_argument("--check", action="store_true",
                    help="record nothing: run the live twins against the recordings and note "
                         "the modules whose twins all pass in tests/data/recorded/checked.json")
    args = ap.parse_args()
    want = pins()
    import flax
    import jax
    import optax
    have = {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__}
    if have != want and not args.any_version:
        raise SystemExit(f"installed {have}, .ci/run pins {want}: install the pins "
                         f"(pip install 'jax[cpu]=={want['jax']}' 'flax=={want['flax']}' "
                         f"'optax=={want['optax']}')")
    env = dict(os.environ, JAX_PLATFORMS="cpu")

    def live_twins(option):
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "parity",
               option, "tests"]
        if args.k:
            cmd[-1:-1] = ["-k", args.k]
        print("+", " ".join(cmd), flush=True)
        return subprocess.call(cmd, cwd=ROOT, env=env)

    if not args.check:
        rc = live_twins("--record-vectors")
        if rc not in (0, 1):  # 1: a live twin found ours differing from jax; the values are jax's
            raise SystemExit(rc)
        if not args.no_legacy:
            for script in ("gen_optax_vectors.py", "make_flax_module_vectors.py",
                           "make_random_vectors.py"):
                c = [sys.executable, os.path.join("tests", "data", script)]
                print("+", " ".join(c), flush=True)
                subprocess.check_call(c, cwd=ROOT, env=env)
    # (a twin that fails, ours against jax or a recording against jax, leaves its module
    # unnoted, so CI keeps running that module's twins)
    rc = live_twins("--stamp-recordings")
    if rc not in (0, 1):
        raise SystemExit(rc)
    print("done: review `git diff --stat tests/data` and rerun the tests")


if __name__ == "__main__":
    main()
