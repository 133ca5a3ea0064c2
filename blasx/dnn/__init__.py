"""blasx.dnn: convolutions (torch.nn.functional conventions) lowered to GEMM tile tasks on the engine.

Lowering. Per group g a forward convolution is ``Y[K, N*P] = W[K, C*R*S] . col(X)[C*R*S, N*P]``. col(X) is a
*derived operand* (runtime/derived.py, im2col.py): it has no memory; a tile of it (a range of the reduction
index (c, r, s) -- (r, s, c) for channels-last x -- by a range of output pixels) is made on the device that
needs it, from the slab of X it reads (host or device memory), by an im2col gather that also does the padding
and a transposed convolution's zero insertion; it is then an ordinary cache line, shared with peers and
evicted, and the im2col matrix never exists in host memory nor crosses the host link. NCHW output is the
column-major ``P x N*K`` matrix, so its C tiles are pixel ranges of one image by channel ranges
(``Y_n^T = col(X_n)^T W^T``); channels-last output is ``K x N*P`` and its tiles span images. Transposed
convolutions and backward-data are convolutions of the input with the flipped, transposed kernel: strided
ones (dilation 1) as stride^d stride-1 convolutions, one per phase of the output (conv_transpose.PHASES), so
the zero-inserted input's zeros are skipped; with dilation, one convolution of the virtually zero-inserted input.
Backward-weights is the long-k GEMM ``dW = dY . col(X)^T`` (planners in runtime/plans/conv.py). The fused
epilogue (bias, per-channel scale and shift, residual, activation) runs on each finished output tile on the
device (epilogue.py); a residual initialises the C tile (with a scale too: the conv and its affine map first,
then the residual and activation in a pass of their own).

Inputs are numpy (host; may exceed a GPU's memory) or CuPy arrays (result on the same device), C-contiguous
NCHW or channels-last (an NCHW-shaped view of NHWC memory; the output keeps the layout; any other strides are
copied to C-contiguous first), of float64, float32 (TF32 with math="tf32"), float16 or bfloat16 (both
accumulate in float32).
"""

import inspect

from .fp_rules import torch_fp_rules
from .writes import retires_writes
from .rnn import gru, gru_backward, lstm, lstm_backward, rnn, rnn_backward
from .conv import conv1d, conv1d_weight, conv2d, conv2d_weight, conv3d, conv3d_weight, conv_bias_grad, linear
from .conv_transpose import (conv1d_input, conv2d_input, conv3d_input, conv_transpose1d, conv_transpose2d,
                             conv_transpose3d)
from .find import NoGpuError, find
from .from_torch import Network, UnsupportedError, from_torch
from .norm import batch_norm, batch_norm_backward, group_norm, group_norm_backward, layer_norm, layer_norm_backward
from . import dropout_ops, lrn, pointwise, pool, softmax_ops, tensors
from .dropout_ops import *  # noqa: F401,F403  (each module's __all__)
from .lrn import *  # noqa: F401,F403
from .pool import *  # noqa: F401,F403
from .pointwise import *  # noqa: F401,F403
from .softmax_ops import *  # noqa: F401,F403
from .tensors import *  # noqa: F401,F403

__all__ = ["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
           "conv1d_input", "conv2d_input", "conv3d_input", "conv1d_weight", "conv2d_weight", "conv3d_weight",
           "conv_bias_grad", "linear", "lstm", "lstm_backward", "gru", "gru_backward", "rnn", "rnn_backward",
           "Network", "from_torch", "UnsupportedError", "find", "NoGpuError", "batch_norm", "batch_norm_backward", "layer_norm", "layer_norm_backward",
           "group_norm", "group_norm_backward",
           *pointwise.__all__, *softmax_ops.__all__, *lrn.__all__, *dropout_ops.__all__, *tensors.__all__, *pool.__all__]

# The package's names (the API): the front ends writing a caller's array outside the engine retire the read-only
# roots it overlaps (writes.py; the modules' own callers write only arrays of their own), and every one computes
# under torch's floating-point rules (fp_rules.py: inf - inf is NaN without numpy's warning).
for _name in __all__:
    _fn = globals()[_name]
    if inspect.isfunction(_fn) and _fn.__module__.startswith(__name__ + "."):
        _wrapped = torch_fp_rules(retires_writes(_fn))
        _wrapped.__module__, _wrapped.__qualname__ = __name__, _name  # (pickled by reference: blasx.dnn.<name>)
        globals()[_name] = _wrapped
del _name, _fn
