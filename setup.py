"""Only the C extension lives here; everything else is in pyproject.toml.

blasx._matmul_loops (what blasx.offload needs to redirect ``a @ b``) is optional:
without a C compiler the install still succeeds, and offload() of ``@`` says so.
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
    ext_modules=[Extension("blasx._matmul_loops", ["blasx/_matmul_loops.c"], optional=True)],
    cmdclass={"build_ext": _NumpyIncludes},
)
