"""Activation functions of fused epilogues and of blasx.dnn's standalone activations: the one table
of their names and parameters, their host (numpy) forms and gradients with torch's formulas, and
the parser of a user's ``activation=`` argument.

The CUDA forms of the same names (forward and gradient) are in ``devices/cuda_epilogue.py``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np


class _Special:
    """scipy.special, imported on first use (``import blasx`` should not pay for it)."""

    def __getattr__(self, name):
        from scipy import special
        return getattr(special, name)


special = _Special()

_SQRT1_2 = 0.70710678118654752440  # 1 / sqrt(2)
_SQRT_2_PI = 0.79788456080286535588  # sqrt(2 / pi)
_INV_SQRT_2PI = 0.39894228040143267794  # 1 / sqrt(2 pi)


def _relu6(x):
    return np.minimum(np.maximum(x, 0), 6)


def _gelu_grad(g, v, p):
    cdf = 0.5 * (1 + special.erf(v * v.dtype.type(_SQRT1_2)))
    return g * (cdf + v * np.exp(v * v * v.dtype.type(-0.5)) * v.dtype.type(_INV_SQRT_2PI))


def _gelu_tanh_grad(g, v, p):
    t = np.tanh(v.dtype.type(_SQRT_2_PI) * (v + v.dtype.type(0.044715) * v * v * v))
    right = 0.5 * v * (1 - t * t) * v.dtype.type(_SQRT_2_PI) * (1 + v.dtype.type(3 * 0.044715) * v * v)
    return g * (0.5 * (1 + t) + right)


def _silu_grad(g, v, p):
    s = special.expit(v)
    return g * s * (1 + v * (1 - s))


class _Form(NamedTuple):
    """One activation: torch's parameter name and default (None: none), the forward f(x, p), what
    torch's backward reads ("input" or "output") and the gradient d(g, v, p) of the input from the
    output's gradient g and that saved value v (torch's backward formula)."""

    param: str | None
    default: float | None
    forward: Callable
    saves: str
    backward: Callable


# name -> its form; every form keeps its arrays' floating type and passes NaN through, as torch's do (a NaN input's
# gradient: NaN, or relu6's 0, as torch's vectorised kernels give them).
_TABLE = {
    "relu": _Form(None, None, lambda x, p: np.maximum(x, 0),
                  "output", lambda g, v, p: np.where(v <= 0, g.dtype.type(0), g)),
    "relu6": _Form(None, None, lambda x, p: _relu6(x),
                   "input", lambda g, v, p: np.where((v > 0) & (v < 6), g, g.dtype.type(0))),
    "leaky_relu": _Form("negative_slope", 0.01, lambda x, p: np.where(x < 0, x * x.dtype.type(p), x),
                        "input", lambda g, v, p: np.where(v > 0, g, g * g.dtype.type(p))),
    "elu": _Form("alpha", 1.0, lambda x, p: np.where(x > 0, x, x.dtype.type(p) * np.expm1(np.minimum(x, 0))),
                 "input", lambda g, v, p: np.where(v > 0, g, g * g.dtype.type(p) * np.exp(np.minimum(v, 0)))),
    "sigmoid": _Form(None, None, lambda x, p: special.expit(x),  # stable for large |x|
                     "output", lambda g, v, p: g * (1 - v) * v),
    "tanh": _Form(None, None, lambda x, p: np.tanh(x),
                  "output", lambda g, v, p: g * (1 - v * v)),
    "gelu": _Form(None, None, lambda x, p: 0.5 * x * (1 + special.erf(x * x.dtype.type(_SQRT1_2))),
                  "input", _gelu_grad),
    "gelu_tanh": _Form(None, None, lambda x, p: 0.5 * x * (1 + np.tanh(x.dtype.type(_SQRT_2_PI)
                                                                     * (x + x.dtype.type(0.044715) * x * x * x))),
                       "input", _gelu_tanh_grad),
    "hardswish": _Form(None, None, lambda x, p: x * _relu6(x + 3) / 6,
                       "input", lambda g, v, p: np.where(v <= -3, g.dtype.type(0),
                                                         np.where(v >= 3, g, g * (v / 3 + v.dtype.type(0.5))))),
    "silu": _Form(None, None, lambda x, p: x * special.expit(x),
                  "input", _silu_grad),
    "hardsigmoid": _Form(None, None, lambda x, p: _relu6(x + 3) / 6,
                         "input", lambda g, v, p: np.where((v > -3) & (v < 3), g / 6, g.dtype.type(0))),
}

#: The activation names, in the order error messages list them.
NAMES: tuple[str, ...] = tuple(_TABLE)
#: What ``activation=`` takes, for error messages.
ALLOWED = ("None, " + ", ".join(repr(n) for n in NAMES)
           + ", ('leaky_relu', negative_slope), ('elu', alpha), ('gelu', 'none' | 'tanh'),"
             " or a dict {'name': ..., <torch's parameter name>: ...}")


class Activation(NamedTuple):
    """A parsed activation: its name (a key of the table) and parameter (leaky_relu's slope,
    elu's alpha; None for the others)."""

    name: str
    param: float | None = None

    def host(self, x: np.ndarray) -> np.ndarray:
        """The activation of the float32 or float64 array ``x`` (a new array of x's type)."""
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            return _TABLE[self.name].forward(x, self.param)

    @property
    def saves(self) -> str:
        """What the gradient reads, torch's choice: "input" (x) or "output" (f(x))."""
        return _TABLE[self.name].saves

    def host_grad(self, grad: np.ndarray, saved: np.ndarray) -> np.ndarray:
        """The gradient of the input from the output's gradient ``grad`` and the saved array
        (:attr:`saves`), both float32 or both float64, by torch's backward formula."""
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            return _TABLE[self.name].backward(grad, saved, self.param)


def _error(value, why: str = "") -> ValueError:
    return ValueError(f"activation: got {value!r}{why}; allowed: {ALLOWED}")


def _param(name: str, value, given):
    """The parameter of ``name`` from ``given`` (None: its default), checked."""
    pname, default = _TABLE[name].param, _TABLE[name].default
    if given is None:
        return default
    if pname is None:
        raise _error(value, f" ({name} takes no parameter)")
    try:
        real = not isinstance(given, (bool, np.bool_)) and isinstance(given, (int, float, np.integer, np.floating)) \
            and np.isfinite(number := float(given))
    except OverflowError:  # (an int beyond float's range)
        real = False
    if not real:
        raise _error(value, f" ({name}'s {pname} must be a finite real number)")
    return number


def parse_activation(value) -> Activation | None:
    """``activation=`` as a user gives it -> an :class:`Activation`, or None for none.

    Takes None, a name ("relu", "gelu", ...), ``(name, param)`` (("leaky_relu", 0.2), ("elu", 0.5),
    ("gelu", "tanh") for torch's approximate="tanh"), a dict ``{"name": name, param_name: param}``
    with torch's parameter names (negative_slope, alpha, approximate), or an Activation. Raises
    TypeError or ValueError naming ``activation``, what it got and what is allowed.
    """
    if value is None:
        return value
    if isinstance(value, Activation):  # (checked as any other: its name known, its parameter or the default)
        name, given = value.name, value.param
    elif isinstance(value, str):
        name, given = value, None
    elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
        name, given = value
    elif isinstance(value, dict) and isinstance(value.get("name"), str):
        rest = {k: v for k, v in value.items() if k != "name"}
        name = value["name"]
        pname = "approximate" if name == "gelu" else _TABLE[name].param if name in _TABLE else None
        if set(rest) - {pname}:
            raise _error(value, f" (unknown keys {sorted(set(rest) - {pname})})")
        given = rest.get(pname)
    else:
        raise TypeError(f"activation: got {value!r} of type {type(value).__name__}; allowed: {ALLOWED}")
    if name == "gelu" and given is not None:  # torch's F.gelu(x, approximate=...)
        if not isinstance(given, str) or given not in ("none", "tanh"):
            raise _error(value, " (gelu's approximate is 'none' or 'tanh')")
        name, given = ("gelu_tanh" if given == "tanh" else "gelu"), None
    if name not in _TABLE:
        raise _error(value, f" (unknown name {name!r})")
    act = Activation(name, _param(name, value, given))
    return value if act == value and isinstance(value, Activation) else act  # (a checked object comes back itself)
