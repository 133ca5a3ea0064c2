"""`import blasx` runs nothing external (no compiler, however CC and PATH are set), and an
installation without the C extension blasx._matmul_loops still works: offload of `@` says what is
missing, np.dot and scipy redirection go on."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest

COMPILERS = ("cc", "gcc", "clang", "c++", "g++", "clang++")


def _run(code: str, cwd, env=None, timeout=50) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_import_runs_no_compiler(tmp_path):
    """Fake compilers that leave a marker and hang first on PATH, CC set to one: the import neither
    waits on them nor runs them."""
    bin_dir, marker = tmp_path / "bin", tmp_path / "compiler-ran"
    bin_dir.mkdir()
    for name in COMPILERS:
        fake = bin_dir / name
        fake.write_text(f"#!/bin/sh\necho \"$0 $*\" >> '{marker}'\nsleep 60\n")
        fake.chmod(fake.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", CC=str(bin_dir / "gcc"),
               CXX=str(bin_dir / "g++"))
    try:
        r = _run("import blasx; print('imported')", cwd=tmp_path, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("`import blasx` waited on a (fake, hanging) compiler")
    assert r.returncode == 0 and "imported" in r.stdout, r.stderr
    assert not marker.exists(), f"`import blasx` ran a compiler: {marker.read_text()}"


def test_without_the_extension_offload_of_matmul_says_what_is_missing(tmp_path):
    code = """
        import sys
        sys.modules["blasx._matmul_loops"] = None  # as if installed without a C compiler
        import numpy as np, blasx
        from blasx import offload as _  # noqa
        import importlib
        O = importlib.import_module("blasx.offload")
        assert not O.matmul_available()
        blasx.configure(devices="sim:2", tile=16)
        for start in (lambda: blasx.offload(threshold=1e4), lambda: blasx.offload_enable(threshold=1e4)):
            try:
                start()
            except RuntimeError as e:
                msg = str(e)
                assert "blasx._matmul_loops" in msg and "C compiler" in msg and "matmul=False" in msg, msg
            else:
                raise AssertionError("offload of @ started without the extension")
            assert not O.offload_active()
        a, b = np.random.rand(40, 30), np.random.rand(30, 20)
        orig_dot = np.dot
        with blasx.offload(threshold=1e4, matmul=False):
            m = blasx.last_profile()
            c = a @ b
            assert blasx.last_profile() is m  # numpy's own
            d = np.dot(a, b)
            assert blasx.last_profile() is not m  # on blasx
        assert np.dot is orig_dot and not O.offload_active()
        np.testing.assert_allclose(d, c, rtol=1e-12)
        print("OK")
    """
    r = _run(code, cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


def test_the_dnn_errors_users_catch_are_public():
    from blasx import dnn
    assert issubclass(dnn.NoGpuError, RuntimeError) and issubclass(dnn.UnsupportedError, ValueError)
    assert {"NoGpuError", "UnsupportedError"} <= set(dnn.__all__)
