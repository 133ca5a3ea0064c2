"""Recurrent layers (issue 22): blasx.dnn against torch (cuDNN on CUDA) in the same run, every result checked.

    python -m bench.rnn                                   # the issue's shapes on GPU 0 vs cuDNN
    python -m bench.rnn --devices cuda:0,1 --layers 4 --hidden 1024 --batch 64   # diagonal on two GPUs
    python -m bench.rnn --devices cuda:0,1 --bidirectional                       # directions on two GPUs
    python -m bench.rnn --deepbench                       # DeepBench's recurrent training shapes (T <= 375)
    python -m bench.rnn --host --layers 2                 # numpy x, the model resident (torch: copies x up, y down)
    python -m bench.rnn --devices sim:2 --peer cpu --hidden 32 --batch 4 --steps 5   # CPU smoke run

Per case (mode, H, B, T, dtype, math, phase): the best wall times of blasx and of the peer (synchronised,
after one untimed call each, the two timed alternately: at least ``--runs`` calls each, more while either
side's timed total is under ``--min-time``, up to 100: short calls are judged on many), their ratio, the
placement blasx used (rnn_plan: single, directions, diagonal, wavefront or batch, and its device count), and
the check: y and h_n (inference), and also the input and every parameter gradient (training) against the
peer's, relative Frobenius error under the dtype's tolerance. ``--overhead`` adds the per-step cost of the step loop launched from Python and replayed from
a CUDA graph. Outputs ``bench/results/rnn-<tag>-<machine>-<stamp>.{json,md}`` with the command, machine and date.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import shlex
import sys
import time

import numpy as np

DEEPBENCH = [  # (hidden, batch, steps, cell): DeepBench's rnn_problems.h training_set, steps <= 375
    *[(h, b, 50, "rnn_tanh") for h in (1760, 2048, 2560) for b in (16, 32, 64, 128)],
    *[(h, b, 25, "lstm") for h in (512, 1024, 2048, 4096) for b in (16, 32, 64, 128)],
    *[(1536, b, 50, "lstm") for b in (8, 16, 32)], *[(256, b, 150, "lstm") for b in (16, 32, 64)],
    *[(h, 32, t, "gru") for h in (2816, 2048, 1536, 2560) for t in (375, 187)], (512, 32, 1, "gru")]
TOL = {"float32": 2e-3, "tf32": 2e-2, "float16": 3e-2, "float64": 1e-9}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.rnn", description=__doc__.split("\n")[0])
    p.add_argument("--devices", default=None, help="blasx devices (default: cuda if a GPU, else sim:2)")
    p.add_argument("--peer", default=None, help="torch device of the reference: cuda (cuDNN) or cpu")
    p.add_argument("--modes", default="lstm,gru")
    p.add_argument("--hidden", default="512,1024,2048")
    p.add_argument("--batch", default="16,64,128")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--bidirectional", action="store_true")
    p.add_argument("--dtypes", default="float32,float16")
    p.add_argument("--math", default="ieee,tf32", help="float32's math modes")
    p.add_argument("--phases", default="inference,training")
    p.add_argument("--deepbench", action="store_true", help="DeepBench's shapes instead of --modes/--hidden/--batch")
    p.add_argument("--overhead", action="store_true", help="also the per-step overhead, eager vs graph")
    p.add_argument("--host", action="store_true",
                   help="host data: blasx gets numpy x (and returns numpy outputs and gradients), the parameters "
                        "resident on the GPU as the peer's model; the peer copies x to its device and its outputs "
                        "(and the input gradient) back")
    p.add_argument("--runs", type=int, default=3, help="timed calls of each side, at least")
    p.add_argument("--min-time", type=float, default=0.1,
                   help="seconds of timed calls each side gets at least (up to 100 calls)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--tag", default="run")
    a = p.parse_args(argv)
    for k in ("modes", "dtypes", "math", "phases"):
        setattr(a, k, [v for v in getattr(a, k).split(",") if v])
    a.hidden = [int(v) for v in a.hidden.split(",")]
    a.batch = [int(v) for v in a.batch.split(",")]
    return a


def cases(args) -> list[dict]:
    shapes = ([(c, h, b, t) for h, b, t, c in DEEPBENCH] if args.deepbench else
              [(m, h, b, args.steps) for m in args.modes for h in args.hidden for b in args.batch])
    out = []
    for mode, h, b, t in shapes:
        for dt in args.dtypes:
            for math in (args.math if dt == "float32" else ["ieee"]):
                for phase in args.phases:
                    out.append(dict(mode=mode, hidden=h, batch=b, steps=t, dtype=dt, math=math, phase=phase,
                                    layers=args.layers, bidirectional=args.bidirectional, host=args.host))
    return out


def _rel(a, ref) -> float:
    a = np.asarray(a, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-30))


def _best(fn, runs: int, sync) -> tuple[list[float], object]:
    """The times of ``runs`` synchronised calls after one untimed call (kernels built, graphs captured), and the
    last call's result."""
    res, times = None, []
    fn()
    for _ in range(max(1, runs)):
        sync()
        t0 = time.perf_counter()
        res = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times, res


MAX_RUNS = 100
# untimed blasx calls before a case's timed ones (one of them _paired's): a repeated call's whole-call graph is
# captured on its second call; training's two slots on calls 2 and 3, their backward graphs on calls 4 and 5
WARM_CALLS = {False: 2, True: 6}


def _paired(peer, mine, runs: int, sync, min_time: float) -> tuple[list, object, list, object]:
    """(peer's times, its last result, mine's times, its last result): one untimed call each, then the two
    timed alternately, at least ``runs`` calls each and more until each side's timed total reaches
    ``min_time`` (at most :data:`MAX_RUNS`), so both sides of a short call are judged on many calls in the
    same windows."""
    peer()
    mine()
    times: tuple = ([], [])
    last = [None, None]
    while len(times[0]) < MAX_RUNS:
        for i, fn in enumerate((peer, mine)):
            sync()
            t0 = time.perf_counter()
            last[i] = fn()
            sync()
            times[i].append(time.perf_counter() - t0)
        if len(times[0]) >= max(1, runs) and min(sum(times[0]), sum(times[1])) >= min_time:
            break
    return times[0], last[0], times[1], last[1]


def _release_pools() -> None:
    """Both sides' cached GPU memory handed back between cases: a sweep's earlier shapes must not leave one
    allocator failing and retrying on every call of a later one."""
    import cupy
    import torch
    torch.cuda.empty_cache()
    cupy.get_default_memory_pool().free_all_blocks()


def run_case(c: dict, peer: str, runs: int, min_time: float = 0.0) -> dict:
    """Time blasx and the peer on one case and check blasx's results against the peer's."""
    import torch

    from blasx import dnn
    gpu = peer == "cuda"
    tdt = getattr(torch, c["dtype"])
    torch.manual_seed(0)
    kw = dict(num_layers=c["layers"], bidirectional=c["bidirectional"])
    cls = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}.get(c["mode"])
    m = (cls(c["hidden"], c["hidden"], **kw) if cls else
         torch.nn.RNN(c["hidden"], c["hidden"], nonlinearity=c["mode"][4:], **kw)).to(peer).to(tdt)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = c["math"] == "tf32"
    x = torch.randn(c["steps"], c["batch"], c["hidden"], device=peer, dtype=tdt) * 0.5
    training = c["phase"] == "training"
    host = c.get("host", False) and gpu  # host data: numpy in and out for blasx, copies for the peer
    if gpu:
        import cupy
        bx = x.cpu().numpy() if host else cupy.from_dlpack(x)
        to_np = cupy.asnumpy
        def sync():  # every GPU: blasx's lanes may run on another than the current one
            for d in range(torch.cuda.device_count()):
                torch.cuda.synchronize(d)
    else:
        bx, to_np, sync = x.numpy(), np.asarray, (lambda: None)
    params = m.state_dict()  # (with --host too: the model stays resident, as the peer's)
    xh = x.cpu()
    fwd = {"lstm": dnn.lstm, "gru": dnn.gru}.get(c["mode"])
    bwd = {"lstm": dnn.lstm_backward, "gru": dnn.gru_backward}.get(c["mode"], dnn.rnn_backward)
    extra = {} if fwd else {"nonlinearity": c["mode"][4:]}
    fwd = fwd or dnn.rnn
    xg = [x.clone().requires_grad_(training)]  # the peer's input with its gradient (host: copied up each run)

    def peer_run():
        if not training:
            with torch.no_grad():
                if not host:
                    return m(x)
                y, st = m(xh.to(peer))
                return y.cpu(), tuple(s.cpu() for s in st) if isinstance(st, tuple) else st.cpu()
        m.zero_grad()
        xin = xg[0] = xh.to(peer).requires_grad_(True) if host else xg[0]
        xin.grad = None
        y, st = m(xin)
        outs = [y, *(st if isinstance(st, tuple) else (st,))]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        if host:
            xin.grad.cpu()
            return y.cpu(), tuple(s.cpu() for s in st) if isinstance(st, tuple) else st.cpu()
        return y, st

    def blasx_run():
        out = fwd(bx, None, params, training=training, math=c["math"], **kw, **extra)
        if not training:
            return out, None
        st = out[1]
        sts = st if isinstance(st, tuple) else (st,)
        ones = [(cupy.ones_like(s) if gpu and not host else np.ones_like(s)) for s in (out[0], *sts)]
        return out, bwd(out[2], *ones)

    if gpu:
        _release_pools()
    from blasx.dnn import rnn_replay
    before = rnn_replay.stats()
    held = None  # (the last call's result kept through the next, as a training loop and _paired hold it)
    for _ in range(WARM_CALLS[training] - 1 if gpu else 0):  # blasx's captures: its first calls, untimed
        held = blasx_run()
    del held
    peer_runs, (ty, tst), blasx_runs, (out, grads) = _paired(peer_run, blasx_run, runs, sync, min_time)
    after = rnn_replay.stats()
    replay = {k: after[k] - before[k] for k in after if k != "failed"}
    if replay["failures"]:
        replay["failed"] = after["failed"]
    t_peer, t_blasx = min(peer_runs), min(blasx_runs)
    from blasx.dnn import rnn_multi
    pl = rnn_multi.last_run().get("placement")
    placement = f"{pl.kind} x{pl.devices}" if pl is not None else "?"
    tst0 = tst[0] if isinstance(tst, tuple) else tst
    st0 = out[1][0] if isinstance(out[1], tuple) else out[1]
    errs = {"y": _rel(to_np(out[0]), ty.detach().float().cpu().numpy()),
            "h_n": _rel(to_np(st0), tst0.detach().float().cpu().numpy())}
    if training:
        errs["input"] = _rel(to_np(grads["input"]), xg[0].grad.float().cpu().numpy())
        for k, p in m.named_parameters():
            errs[k] = _rel(to_np(grads[k]), p.grad.float().cpu().numpy())
    tol = TOL["tf32" if c["math"] == "tf32" else c["dtype"]]
    worst = max(errs, key=errs.get)
    return dict(c, blasx_s=t_blasx, peer_s=t_peer, ratio=t_blasx / t_peer, max_err=errs[worst], worst=worst,
                tol=tol, ok=errs[worst] < tol, placement=placement, blasx_runs=blasx_runs, peer_runs=peer_runs,
                memory=_memory() if gpu else None, replay=replay)


def _memory() -> dict:
    """GiB on the current GPU after a case: free, CuPy's default pool, torch's reserve, blasx's RNN caches (what
    a sweep's earlier shapes leave held)."""
    import cupy
    import torch

    from blasx.dnn import rnn_graph, rnn_replay
    g = 1 << 30
    return {"free": cupy.cuda.runtime.memGetInfo()[0] / g,
            "cupy_pool": cupy.get_default_memory_pool().total_bytes() / g,
            "torch_reserved": torch.cuda.memory_reserved() / g,
            "replay": rnn_replay.held_bytes() / g, "graphs": rnn_graph.held_bytes() / g}


def split_cost(t1: float, t2: float, steps: int) -> tuple[float, float]:
    """(fixed seconds a call, seconds a step) from calls of ``steps`` and ``2 * steps`` steps taking t1 and t2."""
    per = (t2 - t1) / steps
    return t1 - steps * per, per


def step_overhead(hidden: int = 256, batch: int = 16, steps: int = 100, runs: int = 5) -> dict:
    """One LSTM layer's cost three ways (CUDA): launched from Python step by step, its step loop replayed from
    the layer's graph, the whole call replayed from one graph (rnn_replay); each split into a fixed cost a call
    and a cost a step by timing ``steps`` and ``2 * steps`` steps."""
    import cupy
    import torch

    from blasx import dnn
    from blasx.dnn import rnn_graph, rnn_replay

    @contextlib.contextmanager
    def whole_call(on: bool):
        was, rnn_replay.ENABLED = rnn_replay.ENABLED, on
        try:
            yield
        finally:
            rnn_replay.ENABLED = was

    @contextlib.contextmanager
    def eager():
        with whole_call(False), rnn_graph.eager():
            yield
    m = torch.nn.LSTM(hidden, hidden).cuda()
    p = m.state_dict()
    xs = [cupy.random.standard_normal((t, batch, hidden), dtype=cupy.float32) for t in (steps, 2 * steps)]
    sync = cupy.cuda.Device().synchronize
    out = {}
    for name, ctx in (("eager", eager), ("graph", lambda: whole_call(False)), ("replay", lambda: whole_call(True))):
        with ctx():
            (t1, y1), (t2, _) = ((min(t), y) for t, y in (_best(lambda x=x: dnn.lstm(x, None, p)[0], runs, sync)
                                                          for x in xs))
        out[name] = (split_cost(t1, t2, steps), y1)
    res = dict(hidden=hidden, batch=batch, steps=steps, graph_stats=rnn_graph.stats(), replay_stats=rnn_replay.stats())
    for name, ((fixed, per), _) in out.items():
        res[f"{name}_us_per_step"], res[f"{name}_us_fixed"] = 1e6 * per, 1e6 * fixed
    ye = out["eager"][1]
    res["same"] = all(float(cupy.abs(ye - out[k][1]).max()) == 0.0 for k in ("graph", "replay"))
    return res


def step_costs(o: dict) -> str:
    """The overhead record in words: a step's cost and a call's fixed cost for each way measured."""
    ways = [("eager", "launched from Python"), ("graph", "with the layer's step loop replayed from its CUDA graph"),
            ("replay", "with the whole call replayed from one CUDA graph")]
    return "; ".join(f"{o[k + '_us_per_step']:.1f} us a step and {o[k + '_us_fixed']:.0f} us a call {words}"
                     for k, words in ways if k + "_us_per_step" in o and k + "_us_fixed" in o)


def markdown(rep: dict) -> str:
    lines = [f"# bench.rnn: {rep['tag']}", "", f"- command: `{rep['command']}`", f"- date: {rep['date']}",
             f"- machine: {rep['env'].get('host')}, {rep['env'].get('gpus', rep['env'].get('cpu'))}",
             f"- blasx devices: {rep['devices']}; peer: torch on {rep['peer']}"
             + ("; host data (numpy x for blasx, the parameters resident; the peer copies x up and its outputs back)"
                if rep.get("host") else ""), "",
             "| mode | H | B | T | L | dir | dtype | math | phase | blasx ms | peer ms | ratio | max err (worst) | ok "
             "| placement |",
             "| --- | --: | --: | --: | --: | --: | --- | --- | --- | --: | --: | --: | --- | --- | --- |"]
    for r in rep["results"]:
        lines.append(f"| {r['mode']} | {r['hidden']} | {r['batch']} | {r['steps']} | {r['layers']} | "
                     f"{2 if r['bidirectional'] else 1} | {r['dtype']} | {r['math']} | {r['phase']} | "
                     f"{1e3 * r['blasx_s']:.2f} | {1e3 * r['peer_s']:.2f} | {r['ratio']:.2f} | "
                     f"{r['max_err']:.1e} ({r['worst']}) | {'yes' if r['ok'] else 'NO'} | {r.get('placement', '?')} |")
    if rep.get("overhead"):
        o = rep["overhead"]
        lines += ["", f"Step cost (LSTM H={o['hidden']}, B={o['batch']}, T={o['steps']} and {2 * o['steps']}): "
                  + step_costs(o) + f" (same result: {o['same']})."]
    return "\n".join(lines) + "\n"


def machine_tag(devices: str) -> str:
    """The result files' machine part: 'h200' for one GPU, 'h200x2' for two; 'sim' or 'cpu' without CUDA."""
    import blasx
    from bench.machine import gpu_tag
    n = len(blasx.session.cuda_ordinals())
    if not n:
        return devices.split(":")[0]
    return gpu_tag(n).removesuffix("x1")


def main(argv=None) -> int:
    import blasx
    from bench.gemm import jsonable
    from bench.machine import collect_env
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    ngpu = blasx.session._cuda_count()
    devices = args.devices or ("cuda" if ngpu else "sim:2")
    peer = args.peer or ("cuda" if ngpu else "cpu")
    blasx.configure(devices=devices)
    now = _dt.datetime.now(_dt.timezone.utc).astimezone()
    env = collect_env(list(range(ngpu)))
    rep = {"schema": "blasx-bench-rnn/1", "tag": args.tag, "date": now.isoformat(timespec="seconds"),
           "command": shlex.join([os.path.basename(sys.executable), "-m", "bench.rnn", *argv]),
           "devices": devices, "peer": peer, "env": env, "results": [], "overhead": None, "host": args.host}
    for c in cases(args):
        r = run_case(c, peer, args.runs, args.min_time)
        rep["results"].append(r)
        print(f"{r['mode']} H={r['hidden']} B={r['batch']} T={r['steps']} {r['dtype']}/{r['math']} {r['phase']}: "
              f"blasx {1e3 * r['blasx_s']:.2f} ms, peer {1e3 * r['peer_s']:.2f} ms, ratio {r['ratio']:.2f}, "
              f"err {r['max_err']:.1e} {'ok' if r['ok'] else 'FAILED'}, placement {r['placement']}"
              + (", GiB " + " ".join(f"{k} {v:.1f}" for k, v in r["memory"].items()) if r.get("memory") else "")
              + ", replay " + " ".join(f"{k} {v}" for k, v in r["replay"].items()),
              flush=True)
    if args.overhead and peer == "cuda":
        rep["overhead"] = step_overhead()
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"rnn-{args.tag}-{machine_tag(devices)}-{now.strftime('%Y%m%d-%H%M%S')}")
    with open(base + ".json", "w") as f:
        json.dump(jsonable(rep), f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(rep))
    print(base + ".md")
    blasx.shutdown()
    return 0 if all(r["ok"] for r in rep["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
