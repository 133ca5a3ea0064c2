"""The README's Python examples run as written (on the CPU and sims here) and give right answers; the usage
guide documents every environment variable the code reads."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

import blasx

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_the_readme_has_its_examples():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_example_runs(i, tmp_path, monkeypatch):
    if "torch" in BLOCKS[i]:
        pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)  # an example may write a trace file
    space: dict = {}
    try:
        exec(compile(BLOCKS[i], f"README.md example {i + 1}", "exec"), space)
    finally:
        blasx.shutdown()
    if "c" in space and "a" in space and "b" in space and isinstance(space["c"], np.ndarray):
        a, b, c = space["a"], space["b"], space["c"]
        if c.shape == (a.shape[0], b.shape[1]):
            assert np.linalg.norm(c - a @ b) <= 1e-12 * np.linalg.norm(a @ b)
    if "net" in space:
        assert space["y"].shape == (256, 10) and space["z"].shape == (8, 16, 16, 16)


def test_every_environment_variable_the_code_reads_is_in_the_usage_table():
    """Each BLASX_* name in blasx, runtime and heap has its row in docs/usage.md (a new switch came undocumented)."""
    root = README.parent
    names = {m for d in ("blasx", "runtime", "heap") for p in (root / d).rglob("*.py")
             for m in re.findall(r'"(BLASX_[A-Z0-9_]+)"', p.read_text())}
    usage = (root / "docs" / "usage.md").read_text()
    assert names and not [n for n in sorted(names) if f"`{n}`" not in usage]
