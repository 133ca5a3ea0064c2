"""Where the step loops of a recurrent stack run: a pure decision from the shape, and its executor.

The recurrence serialises the steps of one layer-direction, so extra devices help only by running *different*
loops at once. :func:`plan` decides, from (layers, directions, batch, T, devices):

* a unidirectional stack of L >= 2 layers without a projection, on one device or in tensor-core math (float16,
  bfloat16, TF32; ``wide``): layer after layer on x's device through the one-layer loops, every GEMM of the call
  local to it ("single", ``local`` with several devices): there a layer's step is short enough that the diagonal's
  batched GEMM and hand-offs cost more than they save; except TF32 inference on several devices with pieces of
  :data:`MIN_PIECE_STEPS` steps or more, a wavefront (below): its pieces keep the float32 GEMMs' devices busy side
  by side, where training's backward, serial over the layers, and float16's persistent loops gain nothing from it;
* a unidirectional stack of L >= 2 layers without a projection in float32 IEEE or float64 on several devices: the
  diagonal form ("diagonal", rnn_diag.py): at diagonal step s layer l computes time t = s - l, so all layers of a
  group advance together as one batched GEMM (K = input + hidden for every layer) and one fused cell kernel per
  step: L times fewer launches than layer after layer, and a GEMM of L times the rows' work, which fills a GPU that
  one small-batch recurrent GEMM leaves mostly idle. The layers are cut into n = min(devices, L) contiguous groups,
  group g on device g, each a chunk behind the one below; h crosses once per chunk;
* one device otherwise: everything on it ("single");
* a bidirectional stack: the two directions of every layer side by side, direction d on device d ("directions";
  layers stay in sequence, since a bidirectional layer needs all of the layer below before its reverse pass);
* a unidirectional stack of L >= 2 layers with a projection (proj_size): a wavefront ("wavefront"): the layers
  in groups as above, each layer's loop in pieces of ``chunk`` steps (:data:`PIECES` a group); layer l runs
  piece p as soon as layer l-1 has finished it, its input crossing once per piece;
* one unidirectional layer with a large batch (at least :data:`MIN_ROWS` rows per device): the batch rows split
  into contiguous ranges, one per device ("batch"); a smaller batch stays on one device, where a per-step GEMM of
  fewer rows would not run faster, its projection and gradient GEMMs local there too ("single", ``local``).

A call captured whole into one graph (rnn_replay.py) costs no host time a piece: its unidirectional stacks
without a projection in float32 (IEEE or TF32) or float64 run as a wavefront of :data:`CAPTURED_PIECES` pieces a
group in inference, where the diagonal (whose groups issue from threads) cannot be captured, and in TF32 training
too, whose backward, captured in turn, then runs in the same pieces (rnn_wave_backward.py) with the groups' devices
side by side.

On one device, such a stack captured whole (in training too, float32 IEEE included: no diagonal there) runs its
layers as a wavefront of *lanes*: layer l on stream l of the device (``lanes``; at most :data:`MAX_LANES`), in
:data:`LANE_PIECES` pieces, each lane waiting for the one below by an event: a step's GEMM of a small batch fills
a fraction of the GPU's SMs, so the layers' loops run side by side. A several-device captured wavefront runs each
device's group of layers in :data:`GPU_LANES` lanes the same way (within the same work bound for float32 IEEE).

A diagonal chunk is ``ceil(T / (8 n))`` steps, at most :data:`MAX_CHUNK`: the pipeline fills in (n-1) chunks
(about 1/8 of the run) and each hand-off is amortised over several steps. A wavefront piece is a whole one-layer
call (its projection, its loop's graph), so pieces are fewer: ``ceil(T / (PIECES n))`` steps. Layer 0's input
projection and the weight-gradient GEMMs are single GEMMs.
rnn_multi.py executes a placement.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

MIN_ROWS = 64  # batch rows per device below which a batch split is not worth it
MAX_CHUNK = 8  # diagonal steps per hand-off at most
PIECES = 2  # wavefront pieces per group (each piece costs a one-layer call's host time) ...
MIN_PIECE_STEPS = 20  # ... of at least this many steps for TF32 inference (fewer: single, whose loops the host outruns)
CAPTURED_PIECES = 4  # pieces per group of an inference stack captured whole (rnn_replay: no host time a piece) ...
MIN_CAPTURED_STEPS = 8  # ... of at least this many steps
MAX_LANES = 4  # streams of one device a captured stack's layers run on side by side (1: none) ...
LANE_PIECES = 8  # ... in this many pieces a layer; in float32 IEEE and float64 only while a step's batch x hidden
LANE_MAX_WORK = 128 * 1024  # is at most this (larger steps' GEMMs fill the GPU alone: lanes gain nothing)
GPU_LANES = 2  # lanes a device of a captured several-device wavefront (1: none), within LANE_MAX_WORK as above


@dataclass(frozen=True)
class Placement:
    kind: str  # "single", "directions", "diagonal", "wavefront" or "batch"
    devices: int  # devices used
    cells: tuple  # cells[layer][direction] = device (0 .. devices-1)
    rows: tuple = ()  # "batch": the (lo, hi) batch rows of each device
    chunk: int = 0  # "diagonal" and "wavefront": steps per hand-off (0: no hand-off)
    local: bool = False  # "single" on one device of several: every GEMM of the call on that device too
    lanes: tuple = ()  # "wavefront": each layer's stream (lane) on its device; (): one a device


def _group_lanes(cells) -> tuple:
    """Each layer's lane within its device's group of layers: the group's layers in :data:`GPU_LANES` contiguous
    runs."""
    groups = [c[0] for c in cells]
    out = []
    for layer, g in enumerate(groups):
        first, size = groups.index(g), groups.count(g)
        out.append((layer - first) * min(GPU_LANES, size) // size)
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def plan(num_layers: int, num_dirs: int, batch: int, steps: int, n_devices: int,
         projection: bool = False, wide: str | None = None, training: bool = True,
         captured: bool = False, hidden: int = 0) -> Placement:
    """The placement of a stack (pure; see the module docstring for the rules); ``wide``: tensor-core math, its
    class ("reduced" or "tf32", tile.wide_class); ``captured``: the call is being captured whole (rnn_replay);
    ``hidden``: the hidden size."""
    one = tuple(tuple(0 for _ in range(num_dirs)) for _ in range(num_layers))
    stacked = num_dirs == 1 and num_layers >= 2
    n = max(1, min(n_devices, num_layers))
    cells = tuple((layer * n // num_layers,) for layer in range(num_layers))
    chunk = 0 if n == 1 else max(1, min(MAX_CHUNK, math.ceil(steps / (8 * n))))
    piece = math.ceil(steps / (PIECES * n))
    short = math.ceil(steps / (CAPTURED_PIECES * n))
    if stacked and not projection and wide != "reduced" and captured and (not training or wide == "tf32") and \
            n > 1 and short >= MIN_CAPTURED_STEPS:
        laned = GPU_LANES > 1 and (wide or batch * hidden <= LANE_MAX_WORK)
        return Placement("wavefront", n, cells, chunk=short, lanes=_group_lanes(cells) if laned else ())
    lanes = min(MAX_LANES, num_layers)
    if stacked and not projection and wide != "reduced" and captured and n_devices <= 1 and lanes > 1 and \
            math.ceil(steps / LANE_PIECES) >= MIN_CAPTURED_STEPS and (wide or batch * hidden <= LANE_MAX_WORK):
        return Placement("wavefront", 1, one, chunk=math.ceil(steps / LANE_PIECES),
                         lanes=tuple(layer * lanes // num_layers for layer in range(num_layers)))
    if stacked and not projection and wide == "tf32" and not training and n > 1 and piece >= MIN_PIECE_STEPS:
        return Placement("wavefront", n, cells, chunk=piece)
    if stacked and not projection and (wide or n_devices <= 1):
        return Placement("single", 1, one, local=n_devices > 1)
    if stacked and not projection:
        return Placement("diagonal", n, cells, chunk=chunk)
    if n_devices <= 1:
        return Placement("single", 1, one)
    if num_dirs == 2:
        return Placement("directions", 2, tuple((0, 1) for _ in range(num_layers)))
    if stacked:
        return Placement("wavefront", n, cells, chunk=piece)
    n = min(n_devices, batch // MIN_ROWS)
    if n >= 2:
        cuts = [batch * i // n for i in range(n + 1)]
        return Placement("batch", n, one, rows=tuple((cuts[i], cuts[i + 1]) for i in range(n)))
    return Placement("single", 1, one, local=True)
