"""blasx.dnn's own writes into a caller's array (out=, inplace, running statistics) retire the read-only roots
that memory belongs to, as the engine's writes do: a cached tile of it is never served after the write."""

import inspect

import numpy as np
import pytest

import blasx
import blasx.dnn as dnn

RNG = np.random.default_rng(7)
X = RNG.standard_normal((4, 16, 16))
W = RNG.standard_normal((8, 4, 3, 3))
WT = RNG.standard_normal((4, 8, 3, 3))
N = 64

WRITES = {
    "conv2d strided out": lambda f: dnn.conv2d(X, W, padding=1, out=f[:8 * 16 * 18].reshape(8, 16, 18)[:, :, :16]),
    "conv_transpose2d out": lambda f: dnn.conv_transpose2d(X[:, :8, :8], WT, out=f[:8 * 10 * 12].reshape(
        8, 10, 12)[..., :10]),
    "relu out": lambda f: dnn.relu(RNG.standard_normal(N * N), out=f),
    "relu inplace": lambda f: dnn.relu(f, inplace=True),
    "softmax out": lambda f: dnn.softmax(RNG.standard_normal((N, N)), dim=1, out=f.reshape(N, N)),
    "layer_norm out": lambda f: dnn.layer_norm(RNG.standard_normal((N, N)), (N,), out=f.reshape(N, N)),
    "batch_norm running_mean": lambda f: dnn.batch_norm(RNG.standard_normal((8, 4, 5)), f[:4], np.ones(4),
                                                        training=True),
    "max_pool2d out": lambda f: dnn.max_pool2d(RNG.standard_normal((2, 4, 16, 16)), 2, out=f[:512].reshape(
        2, 4, 8, 8)),
}


@pytest.mark.parametrize("name", list(WRITES))
def test_a_dnn_write_through_an_alias_retires_the_cached_root(name, rel_err):
    blasx.configure(devices="sim:2", tile=32)
    b = RNG.standard_normal((N, N))
    root = np.asfortranarray(RNG.standard_normal((N, N)))
    flat = root.reshape(-1, order="F")  # a writable view made before the freeze: blasx writes through it
    root.flags.writeable = False
    assert rel_err(blasx.gemm(1.0, root, b), root @ b) < 1e-12  # root's tiles cached for its life
    before = root.copy()
    WRITES[name](flat)
    assert not np.array_equal(before, root)
    assert rel_err(blasx.gemm(1.0, root, b), np.array(root) @ b) < 1e-12


def test_every_front_end_is_wrapped_for_what_it_sees_and_writes():
    """Every front end: fp_rules' wrapper, then writes' (writable arguments seen; those it writes retired)."""
    for name in dnn.__all__:
        fn = getattr(dnn, name)
        if inspect.isfunction(fn):
            inner = fn.__wrapped__
            assert hasattr(inner, "__wrapped__") and inner.__wrapped__.__name__ == name, name


def test_wrapped_front_ends_pickle_by_reference():
    import pickle
    assert pickle.loads(pickle.dumps(dnn.relu)) is dnn.relu and dnn.relu.__module__ == "blasx.dnn"


def test_drop_written_retires_exactly_the_roots_a_write_overlaps(monkeypatch):
    from blasx.operands import _ReadOnlyRegistry
    reg, retired = _ReadOnlyRegistry(), []
    reg.on_retire = retired.append
    roots = [np.zeros(100 + i) for i in range(50)]
    bases = [reg.base_of(r) for r in roots]
    reg.drop_written([np.zeros(3)])  # memory of no root
    assert retired == []
    alias = np.frombuffer(memoryview(roots[10])[8:16], dtype=np.float64)  # one element of root 10, not a view
    reg.drop_written([alias, roots[20][:0]])  # (an empty array writes nothing)
    assert retired == [bases[10]]
    reg.drop_written([roots[30][5:], roots[31]])
    assert sorted(retired) == sorted([bases[10], bases[30], bases[31]])
    assert reg.base_of(roots[10]) not in bases  # a new base after retirement
