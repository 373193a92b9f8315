"""A fork()ed child of a process that ran parallel CPU kernels works (DESIGN.md: "A forked
child works"). libgomp's thread pool does not survive fork: without care, the child's first
parallel region waits for threads that do not exist there. Each case runs in a fresh
interpreter, which forks; a hung child is killed after a timeout and fails the test."""
import textwrap

from conftest import run_python

# Ops big enough to go parallel (> 32768 elements: PAR_MIN in cpu_ops.c, CT_CHUNK blocks in
# ct_threefry.c, CT_OPT_PAR_MIN in ct_optim.c; a matmul over 2**22 flops), run once before
# the fork and once in the child: an elementwise add, a random fill, an optimizer step, a
# matmul and a reduction. The child exits 0 only if its results equal the parent's (the
# matmul's to rounding) and it was warned, 3 otherwise.
_FORK = textwrap.dedent("""
    import os, sys, time, warnings
    import numpy as np
    import ctrainstate as cts
    import ctrainstate.optim as optim
    from ctrainstate.train_state import TrainState

    N = 1 << 20
    def compute():
        x = cts.device_put(np.arange(N, dtype=np.float32))
        add = np.asarray(x + x)
        key = cts.random.PRNGKey(0)
        rnd = np.asarray(cts.random.normal(key, (N,)))
        s = TrainState.create(apply_fn=None, params={"w": np.ones(N, np.float32)},
                              tx=optim.adamw(1e-2))
        s = s.apply_gradients(grads={"w": np.full(N, 0.5, np.float32)})
        m = cts.device_put(np.arange(512 * 512, dtype=np.float32).reshape(512, 512) / N)
        mm = np.asarray(m @ m)
        total = np.asarray(x.reshape(1024, 1024).sum(axis=0))
        return add, rnd, np.asarray(s.params["w"]), mm, total

    want = compute()
    assert not cts._C.forked_single_threaded()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pid = os.fork()
    if pid == 0:
        try:
            got = compute()
            # bit-equal, but the matmul: the BLAS splits the rows of C over the threads, and
            # one thread's whole-C call may take other kernels than four threads' row blocks
            exact = [np.array_equal(g, w) for i, (g, w) in enumerate(zip(got, want)) if i != 3]
            same = all(exact) and np.allclose(got[3], want[3], rtol=1e-5, atol=0)
            warned = any(issubclass(w.category, RuntimeWarning) and "fork" in str(w.message)
                         for w in caught)
            os._exit(0 if same and warned and cts._C.forked_single_threaded() else 3)
        except BaseException:
            import traceback; traceback.print_exc()
            os._exit(4)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print("child hung"); sys.exit(1)
    code = os.waitstatus_to_exitcode(status)
    print("child exit", code)
    sys.exit(code)
""")


def test_forked_child_runs_parallel_ops_after_parent_did():
    r = run_python(_FORK, {"OMP_NUM_THREADS": "4"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "child exit 0" in r.stdout


def test_forked_child_of_a_process_without_parallel_ops_keeps_its_threads():
    # no kernel ran before the fork: the pool was never started, so the child is not
    # limited to one thread and says nothing
    code = textwrap.dedent("""
        import os, warnings
        import ctrainstate as cts
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pid = os.fork()
        if pid == 0:
            os._exit(0 if not cts._C.forked_single_threaded() and not caught else 3)
        print("child exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    """)
    r = run_python(code, {"OMP_NUM_THREADS": "4"})
    assert r.returncode == 0 and "child exit 0" in r.stdout, r.stdout + r.stderr
