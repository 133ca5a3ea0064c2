"""Scheduling switches, for A/B measurements of the choices the engine makes.

Defaults are the choices that won their A/B measurements; the
environment variable ``BLASX_KNOBS`` (``"chain_kernels=0,late_c=1,commit_steps=64"``)
changes them for an experiment without touching code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Knobs:
    #: Queue GEMM's C tiles in blocks of 2 x (streams / 2) tiles, so one round on a
    #: device shares both A row panels and B column panels.
    block_order: bool = True
    #: Run a device's kernels one at a time in issue order (an event chain across its
    #: streams). Concurrent cuBLAS kernels share the SMs and finish together, which
    #: bunches every write-back at the end; chained, they finish staggered and the
    #: copies overlap the kernels still running.
    chain_kernels: bool = True
    #: For beta != 0, compute alpha op(A) op(B) first and fetch the old C tile only for
    #: the last steps (then C += beta * old): C's host traffic moves out of the start,
    #: where A and B loads already saturate the host link.
    late_c: bool = True
    #: Read a tile a peer is still loading from the host (L2, after its fill) only when the
    #: peer's host link will deliver it before this device's own link could; else load it
    #: from the host here. Off: always wait for the peer's in-flight fill.
    peer_wait_if_sooner: bool = True
    #: TRSM with the explicit inverses of A's diagonal blocks (``plans.plan_trsm(inverse=True)``):
    #: one inversion task per block (``tri_inverse.py`` on GPUs), shared by every device through
    #: the tile cache, and each diagonal solve a triangular multiply by it (cuBLAS runs a
    #: triangular multiply about twice as fast as a solve). Used when a GPU or sim device is in the
    #: engine. Off: each diagonal tile is solved where it is, by cuBLAS trsm recursively blocked
    #: (``trsm_blocks.py``).
    trsm_inverse: bool = True
    #: TRSM's diagonal multiply by a block's inverse (``invmm``) writes into a fresh heap block,
    #: which becomes the task's C tile, instead of into a scratch tile copied back over C (the
    #: copy back is a tenth of the kernel's time). Off: scratch and copy back.
    #: Where C is the caller's device array itself, the copy stays.
    invmm_new_block: bool = True
    #: A horizon for what a GPU commits: it starts another task only while the kernels it has
    #: committed and not yet run add up to less than this many full tile steps (2 T^3 flops,
    #: 8 T^3 for complex types, T the call's tile), besides the cap of 2 x streams tasks in
    #: flight. 0 (default): the cap alone. A committed task cannot move to another GPU, so what
    #: each GPU has committed when the queues run dry is the call's tail imbalance; 64 is the
    #: cap's depth at N = 32768 with T = 4096, counted in flops and so independent of N. Off by
    #: default: it helped only with unequal GPUs in the sim, and real GPUs have not confirmed it.
    commit_steps: int = 0

    @classmethod
    def from_env(cls, text: str | None = None) -> "Knobs":
        text = os.environ.get("BLASX_KNOBS", "") if text is None else text
        kinds = {f.name: type(getattr(cls(), f.name)) for f in fields(cls)}
        changes = {}
        for item in filter(None, (x.strip() for x in text.split(","))):
            key, _, value = item.partition("=")
            kind = kinds.get(key)
            if kind is bool and value in ("0", "1"):
                changes[key] = value == "1"
            elif kind is int and value.isdigit():
                changes[key] = int(value)
            else:
                switches = sorted(k for k, t in kinds.items() if t is bool)
                counts = sorted(k for k, t in kinds.items() if t is int)
                raise ValueError(f"BLASX_KNOBS: got {item!r}; expected name=0 or name=1 with name in {switches}, "
                                 f"or name=N (an int >= 0) with name in {counts}")
        return replace(cls(), **changes)
