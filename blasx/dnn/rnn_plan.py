"""Where the step loops of a recurrent stack run: a pure decision from the shape, and its executor.

The recurrence serialises the steps of one layer-direction, so extra devices help only by running *different*
loops at once. :func:`plan` decides, from (layers, directions, batch, T, devices):

* one device: everything on it ("single");
* a bidirectional stack: the two directions of every layer side by side, direction d on device d ("directions";
  layers stay in sequence, since a bidirectional layer needs all of the layer below before its reverse pass);
* a unidirectional stack of L >= 2 layers: a wavefront ("wavefront"): the layers are cut into n = min(devices, L)
  contiguous groups, group g on device g; layer l runs chunk c of the time steps as soon as layer l-1 has
  finished chunk c, so layer l+1 works on step t while layer l works on later ones, the states handed over once
  per chunk. A chunk is ``ceil(T / (8 n))`` steps, at most :data:`MAX_CHUNK`: the pipeline fills in (n-1)
  chunks (about 1/8 of the run) and each hand-off is amortised over several steps;
* one unidirectional layer with a large batch (at least :data:`MIN_ROWS` rows per device): the batch rows split
  into contiguous ranges, one per device ("batch"); a smaller batch stays on one device, where a per-step GEMM of
  fewer rows would not run faster.

The input projection and the weight-gradient GEMMs are engine calls and spread over every device anyway.
rnn_multi.py executes a placement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_ROWS = 64  # batch rows per device below which a batch split is not worth it
MAX_CHUNK = 8  # wavefront steps per hand-off at most


@dataclass(frozen=True)
class Placement:
    kind: str  # "single", "directions", "wavefront" or "batch"
    devices: int  # devices used
    cells: tuple  # cells[layer][direction] = device (0 .. devices-1)
    rows: tuple = ()  # "batch": the (lo, hi) batch rows of each device
    chunk: int = 0  # "wavefront": steps per hand-off


def plan(num_layers: int, num_dirs: int, batch: int, steps: int, n_devices: int) -> Placement:
    """The placement of a stack (pure; see the module docstring for the rules)."""
    one = tuple(tuple(0 for _ in range(num_dirs)) for _ in range(num_layers))
    if n_devices <= 1:
        return Placement("single", 1, one)
    if num_dirs == 2:
        return Placement("directions", 2, tuple((0, 1) for _ in range(num_layers)))
    if num_layers >= 2:
        n = min(n_devices, num_layers)
        cells = tuple((layer * n // num_layers,) for layer in range(num_layers))
        chunk = max(1, min(MAX_CHUNK, math.ceil(steps / (8 * n))))
        return Placement("wavefront", n, cells, chunk=chunk)
    n = min(n_devices, batch // MIN_ROWS)
    if n >= 2:
        cuts = [batch * i // n for i in range(n + 1)]
        return Placement("batch", n, one, rows=tuple((cuts[i], cuts[i + 1]) for i in range(n)))
    return Placement("single", 1, one)
