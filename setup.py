"""Only the C extensions live here; everything else is in pyproject.toml.

Both are optional: without a C compiler the install still succeeds. blasx._matmul_loops is what
blasx.offload needs to redirect ``a @ b`` (offload() of ``@`` says when it is missing);
blasx._cublas_call issues blasx.dnn's cuBLAS GEMMs in one C call (ctypes stands in without it).
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class _NumpyIncludes(build_ext):
    """numpy's headers, found when the build runs (numpy is a build requirement)."""

    def finalize_options(self):
        super().finalize_options()
        import numpy
        self.include_dirs.append(numpy.get_include())


setup(
    ext_modules=[Extension("blasx._matmul_loops", ["blasx/_matmul_loops.c"], optional=True),
                 Extension("blasx._cublas_call", ["blasx/_cublas_call.c"], optional=True)],
    cmdclass={"build_ext": _NumpyIncludes},
)
