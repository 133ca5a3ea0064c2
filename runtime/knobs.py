"""Scheduling switches, each turning one mechanism on or off for A/B runs (bench/); the defaults are blasx's
behaviour, described in docs/design.md (*Scheduling details*, *Knobs*).
``BLASX_KNOBS`` (``"chain_kernels=0,late_c=1,commit_steps=64"``) changes them without touching code."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Knobs:
    #: Queue GEMM's C tiles in blocks of 2 x (streams / 2): a round on a device shares A row and B column panels.
    block_order: bool = True
    #: One kernel at a time per device, in issue order (an event chain): write-backs overlap the kernels still running.
    chain_kernels: bool = True
    #: For beta != 0, fetch the old C tile for the last steps (C += beta * old), off the start's busy host link.
    late_c: bool = True
    #: Wait for a peer's in-flight host load of a tile only if it arrives before one on this device's link would.
    peer_wait_if_sooner: bool = True
    #: TRSM through explicit inverses of A's diagonal blocks (``plan_trsm(inverse=True)``, a task per block,
    #: shared through the tile cache), then multiplies by them (no row-to-row dependence, unlike a solve; not
    #: a triangular solve numerically: docs/design.md); on engines with a stream device.
    trsm_inverse: bool = True
    #: TRSM's ``invmm`` writes into a fresh heap block that becomes C, instead of a scratch tile copied back
    #: over C (kept where C is the caller's device array).
    invmm_new_block: bool = True
    #: A rotatable task's k-steps start at the running device's share of k (devices starting together load
    #: different tiles). Off: every task sums in the plan's order on any device, so results are bit-identical run
    #: to run on GPUs alone (docs/design.md, *Multi-device results*).
    rotate_steps: bool = True
    #: Split-k for GEMMs whose C has fewer tiles than the devices have streams and whose k is long
    #: (``plans.choose_split``): partial sums over k ranges, reduced in a fixed order.
    split_k: bool = True
    #: Tiles for small calls (``blasx.tile.small_n_tile``): where the default tile gives a GPU fewer than
    #: 2 x streams tasks, the largest multiple of 512 (down to 2048) that does, evened out over C. Off: the
    #: default tile alone (power-of-two halving while a device gets fewer than 2 tasks).
    small_n_tiles: bool = False
    #: A GPU starts another task only while its committed, unrun kernels add up to less than this many full
    #: tile steps (2 T^3 flops, 8 T^3 complex), bounding the tail imbalance. 0: the 2 x streams cap alone.
    commit_steps: int = 0
    #: Threads page-locking one call's host operands (``hostmem.PinJob``). 0: ``hostmem.PIN_THREADS``.
    pin_threads: int = 0
    #: Stage inputs seen for the first time through page-locked pool buffers instead of registering them.
    stage_inputs: bool = True
    #: A chunk a tile copy waits for is page-locked (or staged) next, ahead of the call's order.
    chunks_on_demand: bool = True
    #: A new result starting from the caller's c (``Task.c_init``) gets c's values staged straight into its
    #: own page-locked memory (``Call.init_targets``). Off: c is staged or registered like any other input.
    stage_into_result: bool = True
    #: Each line of in-place TRMM and TRSM (``Task.line``) on one stream device (line i of n on device
    #: i * devices // n, left at the queue's head for it while it has room), at most two lines a device:
    #: fewer tiles cross between devices.
    line_homes: bool = True

    @classmethod
    def from_env(cls, text: str | None = None) -> "Knobs":
        text = os.environ.get("BLASX_KNOBS", "") if text is None else text
        kinds = {f.name: type(getattr(cls(), f.name)) for f in fields(cls)}
        changes = {}
        for item in filter(None, (x.strip() for x in text.split(","))):
            key, _, value = item.partition("=")
            kind = kinds.get(key)
            if key in changes:
                raise ValueError(f"BLASX_KNOBS: {key!r} given twice in {text!r}")
            if kind is bool and value in ("0", "1"):
                changes[key] = value == "1"
            elif kind is int and value.isascii() and value.isdigit():  # (isdigit alone takes '²')
                changes[key] = int(value)
            else:
                switches = sorted(k for k, t in kinds.items() if t is bool)
                counts = sorted(k for k, t in kinds.items() if t is int)
                raise ValueError(f"BLASX_KNOBS: got {item!r}; expected name=0 or name=1 with name in {switches}, "
                                 f"or name=N (an int >= 0) with name in {counts}")
        return replace(cls(), **changes)
