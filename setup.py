"""Build script for ctrainstate's C extension, ctrainstate._C.

Every C file under csrc/core, csrc/backend/cpu and csrc/python is compiled as
C11 against the NumPy C API, with OpenMP. Environment switches:

  CTRAINSTATE_WERROR=1    add -Werror (CI and development builds)
  CTRAINSTATE_SANITIZE=1  build with -fsanitize=address,undefined (see README)
  CTRAINSTATE_DEBUG=1     -O0 -g
"""
import glob
import os

import numpy as np
from setuptools import Extension, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _sources():
    parts = ["csrc/core", "csrc/backend/cpu", "csrc/python"]
    files = []
    for p in parts:
        files += sorted(glob.glob(os.path.join(p, "*.c")))
    return files


def _flag(name):
    return os.environ.get(name, "") not in ("", "0")


cflags = ["-std=c11", "-Wall", "-Wextra", "-fopenmp", "-D_GNU_SOURCE"]
ldflags = ["-fopenmp"]
if _flag("CTRAINSTATE_WERROR"):
    cflags.append("-Werror")
if _flag("CTRAINSTATE_DEBUG") or _flag("CTRAINSTATE_SANITIZE"):
    cflags += ["-O1", "-g", "-fno-omit-frame-pointer"]
else:
    cflags += ["-O3", "-march=x86-64-v2"] if os.uname().machine == "x86_64" else ["-O3"]
if _flag("CTRAINSTATE_SANITIZE"):
    san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    cflags += san
    ldflags += san

ext = Extension(
    "ctrainstate._C",
    sources=_sources(),
    include_dirs=[np.get_include(), "csrc"],
    extra_compile_args=cflags,
    extra_link_args=ldflags,
    libraries=["m"],
)

setup(ext_modules=[ext])
