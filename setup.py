"""Build script for ctrainstate's C extension, ctrainstate._C, and (when a CUDA
toolkit is found) the CUDA backend library ctrainstate._cuda_backend.

Every C file under csrc/core, csrc/process, csrc/backend/cpu and csrc/python is compiled as
C11 against the NumPy C API, with OpenMP. The CUDA backend (csrc/backend/cuda)
is compiled by nvcc for sm_90 plus PTX and linked with cudart and cuBLAS into a
separate shared library that the core loads with dlopen() only when GPUs are
probed, so importing ctrainstate never needs CUDA. Environment switches:

  CTRAINSTATE_WERROR=1    add -Werror (CI and development builds)
  CTRAINSTATE_SANITIZE=1  build with -fsanitize=address,undefined (see README)
  CTRAINSTATE_DEBUG=1     -O1 -g
  CTRAINSTATE_NO_CUDA=1   do not build the CUDA backend
  CUDA_HOME               CUDA toolkit (else nvcc on PATH, else /usr/local/cuda)
  CTRAINSTATE_CUDA_ARCH   gencode list, default "90" (sm_90 + compute_90 PTX)
"""
import glob
import os
import shutil
import subprocess
import sys
import types

import numpy as np
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    return os.environ.get(name, "") not in ("", "0")


def _sources():
    files = []
    for p in ["csrc/core", "csrc/process", "csrc/backend/cpu", "csrc/python"]:
        files += sorted(glob.glob(os.path.join(p, "*.c")))
    return files


def find_cuda():
    """(nvcc, cuda_home) or (None, None)."""
    if _flag("CTRAINSTATE_NO_CUDA"):
        return None, None
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc")
    if nvcc is None and os.path.exists("/usr/local/cuda/bin/nvcc"):
        nvcc = "/usr/local/cuda/bin/nvcc"
    if nvcc is None or not os.path.exists(nvcc):
        return None, None
    home = home or os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    return nvcc, home


cflags = ["-std=c11", "-Wall", "-Wextra", "-fopenmp", "-D_GNU_SOURCE"]
ldflags = ["-fopenmp"]
if _flag("CTRAINSTATE_WERROR"):
    cflags.append("-Werror")
if _flag("CTRAINSTATE_DEBUG"):
    cflags += ["-O1", "-g", "-fno-omit-frame-pointer"]
elif _flag("CTRAINSTATE_SANITIZE"):
    # -g1: the line tables that the sanitizers' reports need for file:line, without the
    # variables' debug information (a third of the compile time)
    cflags += ["-O1", "-g1", "-fno-omit-frame-pointer"]
else:
    cflags += ["-O3", "-march=x86-64-v2"] if os.uname().machine == "x86_64" else ["-O3"]
    # line tables only, in place of Python's -g: backtraces keep file:line, the build takes
    # a quarter less time (CTRAINSTATE_DEBUG=1 for a build to inspect variables in)
    cflags.append("-g1")
if _flag("CTRAINSTATE_SANITIZE"):
    san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    cflags += san
    ldflags += san


# Flags for single files, after the common ones. ct_optim.c: sqrtf without the
# errno path, so its loops vectorise (results are unchanged: sqrt is exact).
PER_FILE_CFLAGS = {
    "csrc/core/ct_optim.c": ["-fno-math-errno"],
}

# nvcc flags for single .cu files, after the common ones. cuda_random.cu and
# cuda_optim.cu must evaluate exactly the float operations of their CPU
# counterparts (csrc/core/ct_random_math.h, ct_optim_math.h): no contraction
# of a * b + c into fma; IEEE division, sqrt and denormals (nvcc's defaults,
# stated so they stay).
PER_FILE_NVCCFLAGS = {
    "cuda_random.cu": ["--fmad=false", "-prec-div=true", "-prec-sqrt=true", "-ftz=false"],
    "cuda_optim.cu": ["--fmad=false"],
    "cuda_convert.cu": ["-ftz=false"],
    "cuda_ewise.cu": ["-ftz=false", "--fmad=false", "-prec-div=true"],
}


def _parallel_compile(self, sources, output_dir=None, macros=None, include_dirs=None, debug=0,
                      extra_preargs=None, extra_postargs=None, depends=None):
    """CCompiler.compile with the sources compiled in parallel (one job per CPU): the same
    steps as distutils' own compile (_setup_compile, _get_cc_args, then _compile per object,
    skipping objects that are up to date), on a thread pool."""
    macros, objects, extra_postargs, pp_opts, build = self._setup_compile(
        output_dir, macros, include_dirs, sources, depends, extra_postargs)
    cc_args = self._get_cc_args(pp_opts, debug, extra_preargs)
    todo = [obj for obj in objects if obj in build]

    def one(obj):
        src, ext = build[obj]
        self._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=max(1, min(len(todo), os.cpu_count() or 1))) as ex:
        for f in [ex.submit(one, obj) for obj in todo]:
            f.result()
    return objects


class BuildExt(build_ext):
    """build_ext that adds PER_FILE_CFLAGS and also builds the CUDA backend library with nvcc."""

    def build_extensions(self):
        compile_one = self.compiler._compile

        def _compile(obj, src, ext, cc_args, extra_postargs, pp_opts):
            rel = os.path.relpath(os.path.abspath(src), ROOT).replace(os.sep, "/")
            return compile_one(obj, src, ext, cc_args,
                               list(extra_postargs) + PER_FILE_CFLAGS.get(rel, []), pp_opts)
        self.compiler._compile = _compile
        self.compiler.compile = types.MethodType(_parallel_compile, self.compiler)
        super().build_extensions()

    def run(self):
        # the CUDA backend (nvcc) builds in a thread while the C extension compiles
        nvcc, home = find_cuda()
        if nvcc is None:
            print("ctrainstate: no CUDA toolkit found; building without the CUDA backend")
            super().run()
            return
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max_workers=1) as ex:
            # the library's path now: build_ext.run clears self.inplace while it runs (and
            # copies only the extensions it built back into the source tree)
            out = self.get_ext_fullpath("ctrainstate._cuda_backend")
            cuda = ex.submit(self.build_cuda, nvcc, home, out)
            try:
                super().run()
            finally:
                cuda.result()   # its error first if both failed: the C one was printed

    def build_cuda(self, nvcc, home, out):
        srcs = sorted(glob.glob(os.path.join(ROOT, "csrc", "backend", "cuda", "*.cu")))
        if not srcs:
            return
        os.makedirs(os.path.dirname(out), exist_ok=True)
        tmp = os.path.join(self.build_temp, "cuda")
        os.makedirs(tmp, exist_ok=True)
        archs = os.environ.get("CTRAINSTATE_CUDA_ARCH", "90").split(",")
        gencode = []
        for a in archs:
            a = a.strip()
            gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        gencode += ["-gencode", f"arch=compute_{archs[-1].strip()},code=compute_{archs[-1].strip()}"]
        common = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC,-Wall,-Wextra", "-I", os.path.join(ROOT, "csrc")]
        if _flag("CTRAINSTATE_WERROR"):
            common += ["-Werror", "all-warnings", "-Xcompiler", "-Werror"]
        objs, cmds = [], []
        headers = glob.glob(os.path.join(ROOT, "csrc", "**", "*.h*"), recursive=True)
        for src in srcs:
            obj = os.path.join(tmp, os.path.basename(src) + ".o")
            if self.force or not os.path.exists(obj) or os.path.getmtime(obj) < max(
                    os.path.getmtime(f) for f in [src] + headers):
                cmd = [nvcc, "-c", src, "-o", obj] + common + gencode
                cmd += PER_FILE_NVCCFLAGS.get(os.path.basename(src), [])
                cmds.append(cmd)
            objs.append(obj)
        # the .cu files compile independently: in parallel (nvcc is slow, and a GPU host has cores)
        from concurrent.futures import ThreadPoolExecutor
        for cmd in cmds:
            print(" ".join(cmd))
        with ThreadPoolExecutor(max_workers=max(1, min(len(cmds), os.cpu_count() or 1))) as ex:
            for f in [ex.submit(subprocess.check_call, cmd) for cmd in cmds]:
                f.result()
        libdirs = [os.path.join(home, d) for d in ("lib64", "lib", "targets/x86_64-linux/lib")]
        link = [nvcc, "-shared", "-o", out] + objs + gencode
        for d in libdirs:
            if os.path.isdir(d):
                link += ["-L", d]
        link += ["-lcublas", "-ldl", "-Xlinker", "-rpath=" + ":".join(d for d in libdirs if os.path.isdir(d))]
        print(" ".join(link))
        subprocess.check_call(link)


ext = Extension(
    "ctrainstate._C",
    sources=_sources(),
    include_dirs=[np.get_include(), "csrc"],
    extra_compile_args=cflags,
    extra_link_args=ldflags,
    libraries=["m", "dl"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
