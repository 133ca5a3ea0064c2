"""blasx.dnn.Network: a graph of blasx.dnn layers (graph.py), compiled by the graph passes (passes.py) and
run on a batch in chunks by the executor (executor.py).

Flow: ``from_torch(module, shape)`` or ``Builder`` -> ``Network(graph)`` -> ``compile()`` (drop identities,
fold batch norm, fuse epilogues, remove dead nodes; record each conv's algorithm, ``algo``) ->
``net(x)``: the buffer plan for the chunk shape
(made once per shape and layout), workers per device (cached with their buffers and the weights in the run's
type), chunks through the workers -> output, and ``last_profile()``.
"""

from __future__ import annotations

import math
import os
import threading
import weakref

import numpy as np

from .. import precision
from ..operands import array_module, is_cupy
from . import executor, passes
from .args import check_dtype, check_dtype_arg, check_flag, is_int
from .graph import Graph, infer_shapes
from .layers import takes_out

LAYOUTS = ("auto", "nchw", "cl")  # auto: channels-last on GPUs (its forms run faster), NCHW on the host engine
CHUNK_MAX = 256  # images a default chunk at most: past it a GPU's layers gain little and its buffers grow
CHUNK_MEMORY_SHARE = 0.5  # of a GPU's free memory, what its workers' default chunks may take together
SCRATCH_FACTOR = 4  # a chunk's device memory over its planned activations (im2col scratch, temporaries)


def default_chunk(n: int, lanes: int, per_image: int, free: int, workers_per_gpu: int) -> int:
    """Images in the default chunk (pure): the batch over the lanes once -- each lane's layers cost the host the
    same per chunk, whatever its size, and a GPU's workers overlap each other's copies -- at most CHUNK_MAX, and
    what fits a worker's share of its GPU's ``free`` bytes at ``per_image`` planned activation bytes an image
    (times SCRATCH_FACTOR); at least 1."""
    fit = int(free * CHUNK_MEMORY_SHARE / workers_per_gpu) // max(1, per_image * SCRATCH_FACTOR)
    return max(1, min(math.ceil(n / lanes), CHUNK_MAX, fit))


#: Every Network: a forked child makes their locks anew (a parent thread may have held one at the fork).
_NETWORKS: "weakref.WeakSet" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for net in list(_NETWORKS):
        net._lock, net._calls = threading.Lock(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Network:
    """A network of blasx.dnn layers; ``net(x)`` runs inference (see the module docstring)."""

    def __init__(self, graph: Graph, input_shape: tuple | None = None):
        if not isinstance(graph, Graph):
            raise TypeError(f"graph: expected a blasx.dnn.graph.Graph, got {type(graph).__name__}")
        self.graph = graph.validate()
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        self.compiled: Graph | None = None
        self.math, self.layout, self.dtype, self.workers_per_gpu, self.graphs = None, "auto", None, 2, True
        self._algos_key, self._algos_val = None, None  # _run_algos's
        self._lock = threading.Lock()
        self._calls = threading.Lock()  # one call at a time runs the workers (their streams and buffers)
        _NETWORKS.add(self)
        self._weights: dict = {}
        self._workers: dict = {}
        self._profile = None
        self.algo: dict = {}
        self._run = None  # (chunk shape, dtype, GPU or None) of the last call: what algos() reports
        self._fuse = False  # the last compile()'s: a call after training or new weights compiles again alike

    # ---------------------------------------------------------------- compile

    def compile(self, dtype=None, math: str | None = None, layout: str = "auto", fuse: bool = True,
                workers_per_gpu: int = 2, graphs: bool = True) -> "Network":
        """Run the graph passes (``fuse=False``: keep the graph as built) and fix the run's options:
        ``dtype`` (None: each call's x's), ``math`` (float32 GEMMs: "ieee" or "tf32"), ``layout`` of the
        activations inside ("nchw", "cl": channels-last, or "auto": channels-last on GPUs, NCHW on the host
        engine; x and the output are NCHW either way), ``workers_per_gpu`` (chunks in flight per GPU),
        ``graphs``: on GPUs, each worker replays a chunk shape's layers from a CUDA graph captured on its
        second chunk (chunk_graph.py; the profile then times replayed chunks as a whole; False: every chunk
        layer by layer, each layer timed)."""
        if dtype is not None:
            dtype = check_dtype_arg("dtype", dtype)
        math = precision.check_math(math)
        if layout not in LAYOUTS:
            raise ValueError(f"layout: got {layout!r}; allowed: {', '.join(map(repr, LAYOUTS))}")
        if not isinstance(workers_per_gpu, int) or workers_per_gpu < 1:
            raise ValueError(f"workers_per_gpu: got {workers_per_gpu!r}; need an int >= 1")
        graphs, fuse = check_flag("graphs", graphs), check_flag("fuse", fuse)
        with self._calls:  # (a call of another thread under way keeps the graph it started with)
            return self._compile(dtype, math, layout, fuse, workers_per_gpu, graphs)

    def _compile(self, dtype, math, layout, fuse, workers_per_gpu, graphs) -> "Network":
        """:meth:`compile` on checked arguments, with ``_calls`` held."""
        g = self.graph
        if fuse:
            g = passes.drop_identities(g)
            g = passes.fold_batchnorm(g, infer_shapes(g, self._example_shape()))
            g = passes.fuse_epilogues(g, infer_shapes(g, self._example_shape()))
        self.compiled = passes.remove_dead(g).validate()
        self.dtype, self.math, self.layout, self.workers_per_gpu = dtype, math, layout, workers_per_gpu
        self._fuse = fuse
        self.graphs, self._algos_key = graphs, None
        self._run = None
        self.algo = self.algos()
        with self._lock:
            self._weights.clear()
            self._workers.clear()
        return self

    def algos(self, chunk_shape: tuple | None = None, dtype=None, device="auto") -> dict:
        """conv node name -> the algorithm its convolution takes: on a GPU the device route's form
        ("depthwise", or conv_direct.forward_form's "shifted"/"im2col": a forced form, else the find-db's
        entry, else the heuristic), "engine" where the layers run on the host engine (no GPU). For input
        chunks of ``chunk_shape`` (None: the network's input shape, else one image), ``dtype`` (None: the
        compiled one, else float32) on ``device`` (a GPU ordinal or model name; None: no GPU; "auto":
        the first GPU the engine uses, if any)."""
        from . import conv_direct, depthwise, direct_cache
        from .geometry import conv_geometry
        if device == "auto":
            from .. import session
            gpus = session.cuda_ordinals()
            device = gpus[0] if gpus else None
        dt = np.dtype(dtype or self.dtype or np.float32)
        g = self.compiled or self.graph
        shape = chunk_shape or (self.input_shape if self.input_shape is not None else self._example_shape())
        shapes = infer_shapes(g, tuple(shape))
        out = {}
        for n in g.nodes:
            xs = shapes.get(n.inputs[0]) if n.op == "conv" and n.inputs else None
            if xs is None:
                continue
            if device is None:
                out[n.name] = "engine"
                continue
            zero, a = np.zeros((), dt), n.attrs
            w = np.broadcast_to(zero, n.params["weight"].shape)
            geo = conv_geometry("conv", a["nd"], np.broadcast_to(zero, xs), w,
                                a.get("stride", 1), a.get("padding", 0), a.get("dilation", 1), a.get("groups", 1))
            with direct_cache.using(direct_cache.Workspace()):  # as the network's workers choose (each has one)
                out[n.name] = "depthwise" if depthwise.applies(geo) else conv_direct.forward_form(
                    geo, dt, conv_direct.FORM, conv_direct.device_layout(self.run_layout(True), geo, dt), self.math,
                    device)
        return out

    def run_layout(self, on_gpus: bool) -> str:
        """The activations' layout of a run on GPUs (``on_gpus``) or on the host engine: the compiled one, "auto"
        resolved."""
        return self.layout if self.layout != "auto" else "cl" if on_gpus else "nchw"

    def _example_shape(self) -> tuple:
        """An input of one image: the batch axis (1 for a time-major recurrent network) of length 1."""
        b = self.graph.batch_axis
        if self.input_shape is not None:
            return (*self.input_shape[:b], 1, *self.input_shape[b + 1:])
        want = tuple(self.graph.nodes[0].attrs.get("shape", ()))
        return (*want[:b], 1, *want[b:])

    @property
    def nodes(self) -> list:
        """The nodes that run: the compiled graph's, else the graph as built."""
        return (self.compiled or self.graph).nodes

    def buffer_plan(self, input_shape: tuple) -> passes.BufferPlan:
        """The activation-buffer plan for an input chunk of ``input_shape``."""
        g = self.compiled or self.graph
        return passes.plan_buffers(g, infer_shapes(g, input_shape), takes_out)

    # ---------------------------------------------------------------- run

    def _check_x(self, x, empty: bool = False):
        if not (isinstance(x, np.ndarray) or is_cupy(x)):
            raise TypeError(f"x: expected a numpy or cupy array, got {type(x).__name__}")
        check_dtype("x", x)
        want = self.graph.nodes[0].attrs.get("shape")
        b = self.graph.batch_axis
        got = tuple(x.shape[:b]) + tuple(x.shape[b + 1:]) if x.ndim > b else None
        if want is not None and got != tuple(want):
            raise ValueError(f"x: expected shape {(*want[:b], 'N', *want[b:])} (N images), got {tuple(x.shape)}")
        if x.shape[b] == 0 and not empty:
            raise ValueError(f"x: got an empty batch (shape {tuple(x.shape)})")

    def _gpus(self, x) -> list:
        if is_cupy(x):
            return [x.device.id]
        from .. import session
        return sorted(set(session.cuda_ordinals()))

    def _weights_on(self, device, dtype) -> dict:
        """node name -> {param: array in ``dtype``} on ``device`` (None: the host), made once."""
        key = (device, np.dtype(dtype).str)
        with self._lock:
            got = self._weights.get(key)
            if got is None:
                got = {}
                for n in self.nodes:
                    if n.params:  # a conv's bias stays on the host: read there, with no wait for the GPU
                        got[n.name] = {k: v if (k == "bias" and n.op in ("conv", "linear")) else _to(v, dtype, device)
                                       for k, v in n.params.items()}
                self._weights[key] = got
        return got

    def _workers_for(self, devices, dtype, chunk_shape) -> list:
        lanes = [(None, 0)] if devices == [None] else [(d, i) for d in devices for i in range(self.workers_per_gpu)]
        lay = self.run_layout(devices != [None])
        key = (tuple(lanes), np.dtype(dtype).str, tuple(chunk_shape), lay, self.graphs)
        with self._lock:
            ws = self._workers.get(key)
        if ws is None:
            plan = self.buffer_plan(chunk_shape)
            g = self.compiled or self.graph
            ws = [executor.Worker(g, plan, chunk_shape, dtype, self.math, self._weights_on(d, dtype), d, lane,
                                  lay, self.graphs) for d, lane in lanes]
            with self._lock:
                self._workers = {key: ws}  # one configuration kept: buffers of another are freed
        return ws

    def __call__(self, x, chunk: int | None = None, progress: bool | None = None):
        """Inference on the batch ``x`` (numpy on the host, of any size, or CuPy on one GPU): chunks of
        ``chunk`` images (None: :func:`default_chunk`, bounded by device memory) through all GPUs of
        the engine (host x), x's GPU (CuPy x) or the host (no GPU: numpy layers on the engine's devices).
        ``progress``: a progress line on stderr (None: only when stderr is a terminal). Calls from several
        threads run one at a time (the workers' streams and buffers are one call's)."""
        from ..progress import wanted
        self._check_x(x, empty=True)
        b = self.graph.batch_axis
        n = x.shape[b]
        if chunk is not None and (not is_int(chunk) or chunk < 1):
            raise ValueError(f"chunk: got {chunk!r}; need an int >= 1 (images a chunk) or None")
        if n == 0:  # torch's empty output, of the shape an image gives
            g = self.compiled or self.graph
            shape = infer_shapes(g, (1, *x.shape[1:])).get(g.output) if b == 0 else None
            xp = array_module(is_cupy(x))
            if shape is None and b == 0:  # (recurrent layers, indexing: one image of zeros run for the shape)
                shape = self(xp.zeros((1, *x.shape[1:]), dtype=x.dtype), progress=False).shape
            if shape is None:
                raise ValueError(f"x: got an empty batch (shape {tuple(x.shape)}); this time-major network's "
                                 f"output shape is not known without running it")
            return xp.empty((0, *shape[1:]), dtype=self.dtype or x.dtype)
        chunk = None if chunk is None else int(chunk)
        import sys
        with self._calls:  # (compile() and set_parameters() from other threads wait for the call)
            if self.compiled is None:  # (never compiled, or dropped by new weights: as the last compile())
                self._compile(self.dtype, self.math, self.layout, self._fuse, self.workers_per_gpu, self.graphs)
            dtype = self.dtype or np.dtype(x.dtype)
            gpus = self._gpus(x)
            devices = gpus if gpus else [None]
            lanes = len(devices) * (self.workers_per_gpu if gpus else 1)
            if chunk is None:
                chunk = self._default_chunk(x, n, lanes, dtype, gpus) if gpus and b == 0 else n
            chunk = min(chunk, n) if b == 0 else n
            chunk_shape = (chunk, *x.shape[1:]) if b == 0 else tuple(x.shape)
            workers = self._workers_for(devices, dtype, chunk_shape)
            self._run = (chunk_shape, dtype, gpus[0] if gpus else None)
            out, self._profile = executor.run(workers, x, b, chunk, wanted(progress, sys.stderr))
            algo = self._run_algos()
            for st in self._profile.layers:
                st.algo = algo.get(st.name, "")
        return out

    def _run_algos(self) -> dict:
        """:meth:`algos` of the last call's chunks, kept while the graph, the forced form and the find-db are
        the same (a call's profile reads it; working it out again per call cost milliseconds). compile()
        forgets it."""
        from .. import perfdb
        from . import conv_direct, finddb
        key = (self._run, self.layout, self.math, conv_direct.FORM, finddb._state(perfdb.default_path()))
        if self._algos_key != key:
            self._algos_key, self._algos_val = key, self.algos(*self._run)
        return self._algos_val

    def _default_chunk(self, x, n: int, lanes: int, dtype, gpus: list) -> int:
        from .direct_cache import free_bytes
        plan = self.buffer_plan((1, *x.shape[1:]))
        import cupy
        with cupy.cuda.Device(gpus[0]):
            free = free_bytes(gpus[0])
        return default_chunk(n, lanes, sum(plan.sizes) * np.dtype(dtype).itemsize, free, self.workers_per_gpu)

    def last_profile(self) -> executor.NetworkProfile | None:
        """The per-layer profile of the last call (time, TFLOPS, device, what each node fused, a conv's
        algorithm), or None."""
        return self._profile

    def summary(self) -> str:
        """One line per node that runs: name, op, inputs, what it fused, a conv's algorithm (for the
        last call's chunks, else as compiled; see :meth:`algos`)."""
        algo = self._run_algos() if self._run is not None else self.algo
        lines = []
        for n in self.nodes:
            fused = n.attrs.get("fused")
            extra = "".join([f" act={n.attrs['activation']}" if n.attrs.get("activation") else "",
                             " +residual" if n.attrs.get("residual") else "",
                             f" fused={'+'.join(fused)}" if fused else "",
                             f" algo={algo[n.name]}" if n.name in algo else ""])
            lines.append(f"{n.name}: {n.op}({', '.join(n.inputs)}){extra}")
        return "\n".join(lines)

    # ---------------------------------------------------------------- training (train.py)

    #: the seed of forward_train's dropout masks (with the call's number and the node's position)
    seed = 0

    def _trainer(self):
        from .train import Trainer
        t = self.__dict__.get("_train")
        if t is None:
            t = self.__dict__["_train"] = Trainer()
        return t

    def forward_train(self, x, math: str | None = None):
        """The output for the batch ``x`` in torch's train() mode, keeping what :meth:`backward` needs:
        the graph as built (no folding or fusion), the whole batch at once on x's device (numpy: the host,
        layers on the engine; CuPy: x's GPU), parameters cast to x's type; batch norm normalises with the
        batch's statistics and updates the running ones (in the graph); dropout masks come from
        :attr:`seed`. The compiled graph is dropped (its folded weights would be stale): the next call
        compiles again with the last compile()'s options."""
        self._check_x(x)
        math = precision.check_math(math if math is not None else self.math)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed: got {self.seed!r}; need an int >= 0")
        y = self._trainer().forward(self.graph, x, self.seed, math)
        self._weights_changed()
        return y

    def backward(self, grad_out):
        """The gradient of the last :meth:`forward_train`'s input for ``grad_out`` (the output's gradient,
        of its type, shape and dtype); parameter gradients are added into :attr:`grads` (as torch
        accumulates; :meth:`zero_grad` clears them). Once per forward_train."""
        from .train import param_table
        return self._trainer().backward(grad_out, param_table(self.graph))

    @property
    def grads(self) -> dict:
        """torch's parameter name -> its accumulated gradient (x's type, on x's device)."""
        return self._trainer().grads

    def zero_grad(self) -> None:
        self._trainer().grads.clear()

    def dropout_masks(self) -> dict:
        """node name -> the boolean keep-mask the last forward_train's dropout used."""
        return dict(self._trainer().masks)

    def parameters(self) -> dict:
        """torch's parameter name -> the network's float64 host array (live: changing it in place changes
        the network; compile() again before inference)."""
        from .train import param_table
        by = self.graph.by_name()
        return {k: by[locs[0][0]].params[locs[0][1]] for k, locs in param_table(self.graph).items()}

    def buffers(self) -> dict:
        """torch's name -> the float64 running statistics of each batch norm (live, as parameters()), and its
        ``num_batches_tracked`` (an int64 0-d copy; set_parameters sets it)."""
        from .train import batch_counts, param_table
        by = self.graph.by_name()
        live = {k: by[locs[0][0]].params[locs[0][1]] for k, locs in param_table(self.graph, True).items()}
        counts = batch_counts(self.graph, self._trainer())
        return {**live, **{k: np.array(v, dtype=np.int64) for k, v in counts.items()}}

    def set_parameters(self, values: dict) -> None:
        """Parameters and buffers by torch's name set from ``values`` (numpy or CuPy arrays of their
        shapes, any float type; all checked before any is written); the compiled graph is dropped."""
        from .train import batch_counts, param_table
        if not hasattr(values, "items"):
            raise TypeError(f"values: expected a mapping name -> array, got {type(values).__name__}")
        table = {**param_table(self.graph), **param_table(self.graph, True)}
        counts = batch_counts(self.graph, self._trainer())
        by = self.graph.by_name()
        unknown = [k for k in values if k not in table and k not in counts]
        if unknown:
            raise ValueError(f"values: unknown names {unknown[:5]}; known: {', '.join(list(table)[:8])}"
                             f"{', ...' if len(table) > 8 else ''}")
        for k, v in values.items():
            want = () if k in counts else by[table[k][0][0]].params[table[k][0][1]].shape
            try:
                kind = np.dtype(getattr(v, "dtype", object)).kind
            except TypeError:  # (a torch tensor's dtype: pass .numpy())
                kind = "O"
            if tuple(getattr(v, "shape", ())) != want or kind not in ("iu" if k in counts else "fiu"):
                dt = getattr(v, "dtype", None)
                what = "an integer array" if k in counts else "a real numpy or CuPy array"
                raise ValueError(f"values[{k!r}]: expected {what} of shape {want}, got {type(v).__name__} of shape "
                                 f"{getattr(v, 'shape', None)}{'' if dt is None else f' and dtype {dt}'}")
        with self._calls:  # (not while a call of another thread reads them)
            for k, v in values.items():
                if k in counts:
                    self._trainer().batches[k.rsplit(".", 1)[0]] = int(v)
                    continue
                for node, key in table[k]:
                    by[node].params[key][...] = v.get() if is_cupy(v) else v
            self._weights_changed()

    def _weights_changed(self) -> None:
        self.compiled = None
        with self._lock:
            self._weights.clear()
            self._workers.clear()


def _to(v: np.ndarray, dtype, device):
    """A float64 parameter in ``dtype`` on ``device`` (None: the host)."""
    a = np.ascontiguousarray(v.astype(dtype))
    if device is None:
        return a
    import cupy
    with cupy.cuda.Device(device):
        out = cupy.asarray(a)
        cupy.cuda.get_current_stream().synchronize()  # (read by every worker's stream; made once)
        return out
