"""What nvcc makes of the fused optimizer kernels (csrc/backend/cuda/cuda_optim.cu), read off
the PTX: no GPU is needed, only the CUDA toolkit that setup.py builds the backend with. Skipped
without nvcc.

The chain kernels' 16-byte form (CTRAINSTATE_OPT_VSTORE=1) exists because nvcc splits a float4
assignment into four 32-bit stores, and because with inline stores in a kernel it no longer
proves the descriptors' pointers global (generic ld.v4.f32). These tests check that the form
keeps what it is for: every 16-byte access of those kernels is a global one, and p, m and v
are written with 16-byte stores. Skipped under tools/sanitize.sh (nothing of ours runs here)."""
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(ROOT, "csrc", "backend", "cuda", "cuda_optim.cu")


def _nvcc():
    exe = shutil.which("nvcc")
    if exe:
        return exe
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return None


@pytest.fixture(scope="module")
def ptx_entries(tmp_path_factory):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("no nvcc (CUDA toolkit) on this machine")
    if os.environ.get("CTRAINSTATE_SANITIZED") == "1":
        # tools/sanitize.sh: these tests read nvcc's output and run none of our C code; the
        # plain test run has checked the same PTX
        pytest.skip("under the sanitizer run: the PTX checks run in the plain test run")
    out = tmp_path_factory.mktemp("ptx") / "cuda_optim.ptx"
    # the flags setup.py compiles the backend with, for the PTX of sm_90
    cmd = [nvcc, "-ptx", SRC, "-o", str(out), "-std=c++17", "-O3", "-I", os.path.join(ROOT, "csrc"),
           "-arch=sm_90", "--fmad=false"]
    # without the sanitizer runtimes tools/sanitize.sh preloads into the test process (nvcc
    # is not built for them and crashes under them)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS",
                                                           "UBSAN_OPTIONS")}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    entries = {}
    for m in re.finditer(r"\.entry\s+(\S+)\((.*?)^\}", text, re.S | re.M):
        entries[m.group(1)] = m.group(2)
    assert entries, "no kernel entries in the PTX"
    return entries


def _ops(body):
    """Counts of each load/store opcode (with its qualifiers) in a kernel body."""
    counts = {}
    for op in re.findall(r"^\s*(?:@!?%p\d+\s+)?((?:ld|st)\.[a-z0-9.]+)", body, re.M):
        counts[op] = counts.get(op, 0) + 1
    return counts


def _chain_kernels(entries, vstore):
    # opt_chain_kernel<CH, U, VS>: the mangled name ends in ...ELi<U>ELb<VS>EEv...
    tag = f"ELb{1 if vstore else 0}EEv"
    names = [n for n in entries if n.startswith("_Z16opt_chain_kernel") and tag in n]
    return names


def test_every_chain_kernel_is_built_in_both_forms(ptx_entries):
    # six chains x unroll 1 and 2, for each form
    assert len(_chain_kernels(ptx_entries, False)) == 12
    assert len(_chain_kernels(ptx_entries, True)) == 12


def test_vstore_chain_kernels_access_16_bytes_globally(ptx_entries):
    for name in _chain_kernels(ptx_entries, True):
        ops = _ops(ptx_entries[name])
        assert ops.get("ld.global.v4.f32", 0) >= 1, (name, ops)
        assert ops.get("st.global.v4.f32", 0) >= 1, (name, ops)
        generic16 = {k: v for k, v in ops.items() if re.fullmatch(r"(ld|st)\.v4\.[a-z0-9]+", k)}
        assert not generic16, (name, generic16)


def test_adamw_vstore_kernel_writes_p_m_v_with_16_byte_stores(ptx_entries):
    # adamw = opt_chain<ADAM (1), DECAY (2), SCALE (0)>; unrolled twice: a thread's group of 8
    # elements writes two quads of m, v and p (or out); unrolled once, one quad of each. Each
    # path stores m, v, and p or out, so at least 3 16-byte stores per quad of the group.
    names = [n for n in _chain_kernels(ptx_entries, True) if "opt_chainILi1ELi2ELi0ELin1EE" in n]
    assert len(names) == 2, names
    for name in names:
        ops = _ops(ptx_entries[name])
        quads = 2 if "ELi2ELb1" in name else 1
        assert ops.get("st.global.v4.f32", 0) >= 3 * quads, (name, ops)
        assert ops.get("ld.global.v4.f32", 0) >= 4 * quads, (name, ops)  # g, p, m, v
        # against the default form of the same kernel: the quads' 32-bit stores are gone
        # (four per 16-byte store, for m, v and p; what is left stores the unaligned tail)
        ops0 = _ops(ptx_entries[name.replace("ELb1EEv", "ELb0EEv")])

        def st32(o):
            return sum(v for k, v in o.items() if re.fullmatch(r"st(\.global)?\.f32", k))
        assert st32(ops0) - st32(ops) >= 4 * 3 * quads, (name, ops0, ops)
