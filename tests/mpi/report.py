"""The result line of a script run under mpirun: printed, and where CT_TEST_OUT names a folder,
also added to that folder's file of this process (mpirun's forwarding of the processes'
output may merge their lines), which the pytest wrappers read."""
import json
import os
import sys

import numpy as np


def report(me: int, line: str) -> None:
    print(line, flush=True)
    if os.environ.get("CT_TEST_OUT"):
        with open(os.path.join(os.environ["CT_TEST_OUT"], str(me)), "a") as f:
            f.write(line + "\n")


# tests/mpi/global_all.py runs several checking scripts' mains in one job: it starts the
# distributed runtime once, and `finish` hands it each script's count here instead
collected = None


def start(dist) -> None:
    """The start of a checking script's main: the distributed runtime initialized (unless
    global_all.py, running this script among others, already did)."""
    if not dist.is_initialized():
        dist.initialize(timeout=60)


def finish(dist, me: int, n: int, checks: int) -> None:
    """The end of a checking script's main: shut the distributed runtime down, then report
    how many checks this process passed (the wrapper compares it with its least); under
    global_all.py, the count to it (which reports each script's and shuts down at the end)."""
    if collected is not None:
        collected.append(checks)
        return
    dist.shutdown()
    report(me, f"OK {me} {n} {checks}")


def run(main, reference) -> None:
    """A checking script's entry point: ``--reference OUT`` runs ``reference(OUT)`` (the
    one-process values the processes compare with), anything else ``main(arg)``."""
    if sys.argv[1] == "--reference":
        reference(sys.argv[2])
    else:
        main(sys.argv[1])


def raw(a):
    """A host array numpy can save (bfloat16 as its 16-bit words)."""
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype.name == "bfloat16" else a


def save_reference(path, n, out, specs) -> None:
    """The reference run's file: the values ``out`` (name -> host array) and their shardings
    ``specs`` (name -> a JSON-able description)."""
    np.savez(path, __specs__=np.array(json.dumps(specs)), **out)
    print("REFERENCE", n, len(out))


def compare(out, specs, ref) -> int:
    """``out`` / ``specs`` against the reference run's file ``ref``: the same names, shardings
    and bytes; the number of values checked."""
    ref_specs = json.loads(str(ref["__specs__"]))
    assert sorted(f for f in ref.files if f != "__specs__") == sorted(out), (
        sorted(set(ref.files) ^ set(out)))
    assert specs == ref_specs, {k: (specs[k], ref_specs.get(k)) for k in specs
                                if specs[k] != ref_specs.get(k)}
    for k, v in out.items():
        want = ref[k]
        v = np.asarray(v)
        assert v.dtype == want.dtype and v.shape == want.shape, (k, v.dtype, v.shape)
        assert v.tobytes() == want.tobytes(), k
    return len(out)
