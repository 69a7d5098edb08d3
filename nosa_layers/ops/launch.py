"""Launch settings of the NOSA Triton kernels, in one place: the tables (the attention kernels per GPU
architecture, the selection's scoring and top-k kernels), the table a device runs (``launch_config``),
whether the hand-scheduled Hopper kernels can run, and scoped overrides for experiments.

A leaf of ``nosa_layers.ops``: the kernel modules import it, it imports none of them (``attention_sm90``
is loaded on first use, by :func:`sm90_kernels`). A benchmark or test that tries other settings passes
them to :func:`overrides` for the duration of a ``with`` block instead of editing the tables::

    with overrides(SEL_CONFIG, lse=dict(SEL_CONFIG["lse"], HP=2)):
        block_scores_triton(...)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
from collections.abc import Iterator, MutableMapping

import torch
import triton
from packaging.version import Version
from torch import Tensor

from ._common import interpreting

_OVERRIDES: contextvars.ContextVar[dict] = contextvars.ContextVar("nosa_launch_overrides", default={})


class LaunchTable(MutableMapping):
    """Launch settings ``{kernel or device kind: settings dict}``: the defaults, read through the entries
    that :func:`overrides` puts in force in the current context. Reading never changes the defaults."""

    def __init__(self, name: str, defaults: dict) -> None:
        self.name = name
        self.defaults = defaults

    def __getitem__(self, key: str) -> dict:
        over = _OVERRIDES.get().get(id(self), {})
        return over[key] if key in over else self.defaults[key]

    def __setitem__(self, key: str, value: dict) -> None:  # the defaults (tests patch them)
        self.defaults[key] = value

    def __delitem__(self, key: str) -> None:
        del self.defaults[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.defaults)

    def __len__(self) -> int:
        return len(self.defaults)

    def __repr__(self) -> str:
        return f"LaunchTable({self.name!r}, {dict(self.items())})"


@contextlib.contextmanager
def overrides(table: LaunchTable, **entries: dict) -> Iterator[LaunchTable]:
    """``table`` with ``entries`` (each a whole settings dict) in place of its own inside the block, for
    this context only (nested blocks stack; the defaults are untouched)."""
    unknown = set(entries) - set(table.defaults)
    if unknown:
        raise KeyError(f"nosa_layers.ops: {table.name} has no entry {', '.join(sorted(unknown))}")
    now = _OVERRIDES.get()
    token = _OVERRIDES.set({**now, id(table): {**now.get(id(table), {}), **entries}})
    try:
        yield table
    finally:
        _OVERRIDES.reset(token)


# Attention kernels, per GPU architecture (compute capability major version; the interpreter uses
# sm90's). ``tile.rows``: rows of a query tile (``qt`` tokens x the heads of a KV group, see
# ``sparse_index.query_tile``); per kernel: ``rows`` (M of its programs: heads packed per program =
# rows // qt, at most G), warps, pipeline stages. Forward and dQ take one KV block per list entry
# (128-key entries were slower on the H200 in every case measured). dK/dV: ``blocks`` KV blocks per
# key group (keys resident in one program, see ``sparse_index``), ``CHUNK`` units of work per list
# piece (a unit = 64 query rows x one KV block; an entry is qt x G rows x ``blocks``; "auto": about
# ``CHUNK_WAVES`` pieces per SM of the attention's estimated work, see ``sparse_index.chunk_units``)
# and ``SLOTS``, the budget of one-block fp32 partials (64 KiB each at D = 128; a group's partial
# takes ``blocks`` of them) for the pieces of split lists; the backward allocates only the slots an
# index uses. Real NOSA selections share their query-agnostic blocks across all later queries, so
# their inverse lists are long; lists past the budget run whole in one program and the kernel waits
# on them (bench.attention --balance-sweep on the H200: budget 512 -> 16384 and "auto" chunks took
# the backward on smooth selections from 33.2 to 25.2 ms at 32K/32 and 7.29 to 6.16 ms at 16K/16).
# Two-block groups made the Triton dK/dV up to 22% faster on the H200 (they need 8 warps, with 4 the
# accumulators spill); the warp-specialised Hopper kernel prefers one-block groups (below). sm80 (A100 / A800,
# 164 KB shared memory per SM) keeps one-block groups, the configuration measured there, and every
# kernel under 100 KB of shared memory and its measured piece settings (the balance sweep ran on the
# H200 only); ``test_arch`` compiles every kernel for both targets.
# ``impl = "gluon"``: on sm90 GPUs the kernel is the hand-scheduled Hopper one (``attention_sm90``;
# forward, dQ: TMA ring of ``num_stages`` K/V slots, overlapped wgmma, the A operands Q / dO in
# registers with ``regs``) for the shapes it covers (16-bit, D 64 / 128, 64-key blocks, 64-row tiles);
# other GPUs and shapes take the Triton kernel, which computes the same (bit for bit in the H200 runs, except the
# two-entry forward below: one softmax step per 128 keys rounds differently, within the reference tolerances).
# bench.attention --fwd-sweep on the H200 (after the per-entry loads moved one entry
# ahead): 3 forward slots were 3-5% faster at 16K/16 in all three cases (P1, iid, smooth) and within the
# sweep's 4% noise at 32K/32; dQ with Q / dO in shared memory (245 registers, no spill, against 255
# and a small spill) was at or below the others in 5 of the 6 cases. dK/dV ``impl = "gluon"``: warp-specialised
# (a TMA producer warp, a consumer warpgroup per key block, no CTA-wide barrier per step);
# bench.attention --dkdv-sweep on the H200: one-block groups, 32 rows per step, 3 slots, two programs
# per SM, are the fastest on real selections (smooth / iid: 20-25% below the Triton kernel's two-block
# groups) and within 3% of two-block groups on P1 lists. Where the Hopper kernels cannot run
# (``hopper_device``) or do not cover the shape (head dim 256, fp32, 16- / 32-key blocks; the index
# builder is told the queries), the Triton dK/dV keeps its two-block groups (``dkdv["triton"]``).
# The Hopper forward takes two list entries per step (``keys_per_step = 128``, ``attention_sm90_pairs``:
# one 128-key score product and one P V product per pair, 64-row tiles) where it covers the tile; 64 is
# the one-entry kernel above (``num_stages``, ``regs`` are its settings). bench.attention --fwd-sweep
# on the H200: 128 keys per step 6% faster at 32K/32 on P1 lists (1.31x ideal), 3-5% on real
# selections, within 3% either way at 16K/16; two 64-key products per pair and two warpgroups taking
# turns at the tensor cores (FlashAttention-3's ping-pong) were slower and are not kept.
# Override for experiments (bench.attention --sweep, --dkdv-sweep).
CONFIG = {
    "sm90": LaunchTable("attention sm90", {
        "tile": dict(rows=64),
        "fwd": dict(rows=64, num_warps=4, num_stages=3, impl="gluon", regs=True, keys_per_step=128,
                    triton=dict(num_stages=2)),
        "dq": dict(rows=64, num_warps=4, num_stages=2, impl="gluon", regs=False),
        "dkdv": dict(rows=32, num_warps=8, num_stages=3, CHUNK="auto", SLOTS=16384, blocks=1, impl="gluon",
                     triton=dict(blocks=2, num_stages=4)),
    }),
    "sm80": LaunchTable("attention sm80", {
        "tile": dict(rows=64),
        "fwd": dict(rows=64, num_warps=4, num_stages=2, impl="triton", regs=False),
        "dq": dict(rows=64, num_warps=4, num_stages=2, impl="triton", regs=False),
        "dkdv": dict(rows=64, num_warps=4, num_stages=2, CHUNK=1024, SLOTS=512, blocks=1, impl="triton"),
    }),
}

# The selection's scoring kernels (LSE: compressed keys per step ``BW`` and query heads per
# program ``HP``, a divisor of the KV group's G is taken; block scores: windows per step ``NW``, i.e.
# NW / (block / stride) blocks, and ``NT`` windows per step for a row's last blocks that do not fill
# an ``NW`` step). Tuned on one H200 for block 64, D 128 (bench.attention --selection --sel-sweep:
# HP 2 against 1, scoring 2.25 -> 2.12 ms at 32K/32; later, with the tail steps and
# the masks only where needed: HP 4 / 8 warps and NW 128 / NT 64 / 4 warps, the fastest at 32K/32
# and 16K/16, 1.57 -> 1.49 and 0.25 -> 0.21 ms against HP 2 / NW 256); override for experiments.
SEL_CONFIG = LaunchTable("selection", {
    "lse": dict(BW=64, HP=4, num_warps=8, num_stages=2),
    "block": dict(NW=128, NT=64, num_warps=4, num_stages=2),
})

# The fused top-k (``topk.py``): ``TILE`` rows x padded blocks per register tile, ``ROW_SPLITS`` programs per
# (KV block, KV head), each ranking 1 / ROW_SPLITS of the block's rows, and ``WARPS`` per program
# (0: one per 512 tile elements, at least 1). H200 (bench.attention
# --selection --sel-sweep): 256 x 8 took the top-k from 0.75 to 0.56 ms at 32K/32 and from 0.40 to
# 0.18 ms at 16K/16 against 1024 x 1 (more programs hide the latency of the counting passes); then
# 256 x 16 with one warp per 512-wide row (the counts summed within a warp, no cross-warp step)
# 0.57 -> 0.52 ms and 0.18 -> 0.12 ms. The interpreter (CPU tests) runs fewer, longer programs,
# which it runs faster.
TOPK_CONFIG = LaunchTable("top-k", {
    "cuda": dict(TILE=256, ROW_SPLITS=16, WARPS=0),
    "interpreter": dict(TILE=1024, ROW_SPLITS=1, WARPS=0),
})


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    """Compute capability of CUDA device ``index`` (asked once: a launch consults it several times)."""
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of the CUDA ``device``."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def arch(device: torch.device) -> str:
    """``sm90`` for Hopper and newer data-center GPUs (and the interpreter), ``sm80`` otherwise."""
    if device.type != "cuda" or interpreting():
        return "sm90"
    major, minor = capability(device)
    return "sm90" if major in (9, 10) else "sm80"


def launch_config(device: torch.device, q: Tensor | None = None, block: int | None = None) -> dict:
    """Launch settings of the attention kernels for ``device``. Where the Hopper kernels cannot run (the
    interpreter, another sm9x / sm10x GPU, a triton without Gluon) or do not cover the attention's queries
    ``q`` with KV blocks of ``block`` keys (when given; ``attention_sm90.covers``), a kernel with Triton
    settings of its own takes them instead of the Hopper kernel's (``dkdv["triton"]``: two-block groups;
    ``fwd["triton"]``: two K/V stages, the setting measured for the Triton forward)."""
    cfg = CONFIG[arch(device)]
    hopper = hopper_device(device) and (q is None or sm90_kernels().covers(q, block))
    return cfg if hopper else triton_settings(cfg)


def triton_settings(cfg) -> dict:
    """The launch table ``cfg`` as the Triton kernels run it: each kernel's own ``triton`` overrides
    applied (a copy of those kernels' entries; the others are ``cfg``'s own)."""
    return {name: dict(c, **c["triton"]) if "triton" in c else c for name, c in cfg.items()}


GLUON_MIN_TRITON = "3.6"  # the Hopper kernels' Gluon API: written and compiled with triton 3.6 and 3.8


@functools.cache
def sm90_kernels():
    """The ``attention_sm90`` module (the Hopper kernels' launches), or ``None`` (with one warning) where the
    installed triton is older than ``GLUON_MIN_TRITON`` or has no Gluon Hopper API: then every kernel takes
    the Triton path."""
    why = None
    if Version(triton.__version__).release < Version(GLUON_MIN_TRITON).release:
        why = f"triton {triton.__version__} is older than {GLUON_MIN_TRITON}"
    else:
        try:
            from . import attention_sm90
        except (ImportError, AttributeError) as e:
            why = str(e)
    if why is not None:
        warnings.warn(f"nosa_layers.ops: the Hopper attention kernels need Gluon (triton >= {GLUON_MIN_TRITON}): "
                      f"{why}; using the Triton kernels", stacklevel=2)
        return None
    return attention_sm90


def hopper_device(device: torch.device) -> bool:
    """Whether the hand-scheduled Hopper kernels can run on ``device``: an sm90 GPU (wgmma is
    Hopper-only), not the interpreter, a triton with the Gluon API they are written for."""
    if device.type != "cuda" or interpreting():
        return False
    return capability(device) == (9, 0) and sm90_kernels() is not None
