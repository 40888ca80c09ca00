"""Build the Cython extensions of adtape/ and kernels/.

Every ``.pyx`` under ``adtape/`` and ``kernels/`` becomes an extension module.
Environment switches:
  ADTAPE_NATIVE=1  compile with -march=native (off by default: wheels stay portable)
  ADTAPE_DEBUG=1   turn Cython's bounds/wraparound/None checks back on, build with -O0 -g
  ADTAPE_BUILD_ONLY=glob[,glob]  build only the matching .pyx files (development)
"""
import fnmatch
import glob
import os
import subprocess
import sys
import sysconfig
import tempfile
import warnings

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("ADTAPE_DEBUG", "") not in ("", "0")
NATIVE = os.environ.get("ADTAPE_NATIVE", "") not in ("", "0")


def openmp_flags():
    """Return (compile, link) flags for OpenMP, or ([], []) with a loud warning."""
    cc = sysconfig.get_config_var("CC") or "cc"
    cc = cc.split()[0]
    src = "#include <omp.h>\nint main(void){int n=0;\n#pragma omp parallel reduction(+:n)\nn+=1;\nreturn n>0?0:1;}\n"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.c")
        with open(path, "w") as f:
            f.write(src)
        try:
            res = subprocess.run([cc, "-fopenmp", path, "-o", os.path.join(d, "t")],
                                 capture_output=True)
            ok = res.returncode == 0
        except OSError:
            ok = False
    if ok:
        return ["-fopenmp"], ["-fopenmp"]
    banner = "*" * 72
    msg = (f"\n{banner}\nOpenMP is NOT available to {cc}: building SERIAL kernels.\n"
           "Training will use one core. Install a compiler with OpenMP (gcc, or clang\n"
           f"with libomp) and reinstall for parallel kernels.\n{banner}\n")
    warnings.warn(msg)
    sys.stderr.write(msg)
    return [], []


omp_compile, omp_link = openmp_flags()
compile_args = ["-O0", "-g"] if DEBUG else ["-O3"]
# -fno-math-errno: no kernel reads errno, and without it gcc keeps sqrtf scalar
# (a libm call for negative inputs) instead of one vector square root.
compile_args += ["-fno-math-errno", "-Wno-unreachable-code", "-Wno-unused-function", "-Wno-format-truncation"]
if NATIVE:
    compile_args.append("-march=native")

ONLY = [g for g in os.environ.get("ADTAPE_BUILD_ONLY", "").split(",") if g]

extensions = []
for pyx in sorted(glob.glob("adtape/*.pyx") + glob.glob("kernels/*.pyx")):
    if ONLY and not any(fnmatch.fnmatch(pyx, g) for g in ONLY):
        continue
    module = pyx[:-4].replace(os.sep, ".")
    extensions.append(Extension(
        module, [pyx],
        include_dirs=[numpy.get_include(), "kernels"],
        depends=glob.glob("kernels/*.h"),
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=compile_args + omp_compile,
        extra_link_args=omp_link + ["-lpthread"],
    ))

directives = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "nonecheck": DEBUG,
    "cdivision": not DEBUG,
    "embedsignature": True,
}

setup(
    ext_modules=cythonize(extensions, compiler_directives=directives,
                          compile_time_env={"ADTAPE_OPENMP": bool(omp_compile)},
                          nthreads=os.cpu_count() or 1),
)
