"""The device-route forms a blasx.dnn convolution call ran, for bench.conv's limit notes: the route's plan makers
and form entry points wrapped while the call runs. Only a first call chooses (later ones replay), so bench.conv
records its first, untimed call."""

from __future__ import annotations

import contextlib


def _targets() -> list:
    """(module, function name, the form its call stands for: a name, or a function of its result)."""
    from blasx.dnn import conv_direct, conv_transpose, depthwise, direct_cuda
    return [(direct_cuda, "forward_plan", lambda plan: plan.form), (direct_cuda, "weight_plan", lambda plan: plan.form),
            (direct_cuda, "transposed_plan", "col2im"), (conv_transpose, "_phase_calls", "phases"),
            (depthwise, "forward", "depthwise"), (depthwise, "weight", "depthwise"),
            (conv_direct, "in_layout", "channels-last copies")]


@contextlib.contextmanager
def recorded(out: list):
    """Appends to ``out`` each form (once, in the order first met) the calls inside the block run; the functions
    are restored after it. One thread's calls only (the wrappers are module attributes)."""
    saved = []
    try:
        for module, name, form in _targets():
            fn = getattr(module, name)

            def wrapper(*args, _fn=fn, _form=form, **kwargs):
                result = _fn(*args, **kwargs)
                got = _form if isinstance(_form, str) else _form(result)
                if got not in out:
                    out.append(got)
                return result
            setattr(module, name, wrapper)
            saved.append((module, name, fn))
        yield out
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)
