"""Known third-party startup noise folded into one line.

Importing megatron-core without its optional accelerators prints a warning per module ("Transformer
Engine and Apex are not installed. Falling back to ...", "Apex is not installed. Falling back to
Torch Norm"), and megatron-core, torch and torch.distributed.checkpoint add deprecation notices about
their own internals (``GPTModel IS DEPRECATED``, "MCore's async save is deprecated", "full scope is
deprecated", ShardedTensor, ``dcp.load``'s argument order, single-process loading, the collectives
megatron-core calls by their old names, its experimental MIMO config, and torch's note on a non-leaf ``.grad``
read by megatron-core's gradient buffers on CPU); in a single-process tool its rank lookup says it
found no process group, and on a CPU its tensor-parallel layers recommend a CUDA setting. None of them
asks the user to do anything. :func:`quiet_third_party` drops them and prints, once and on rank 0
only, one line naming the optional packages that are missing (on stdout with the program's other
progress lines, so stderr keeps only errors)::

    note: optional packages not installed: Transformer Engine, Apex (megatron-core runs its PyTorch fallbacks)

Every other warning is shown as usual. ``NOSA_THIRD_PARTY_WARNINGS=1`` shows them all. It lives in
``data`` because the data tools import megatron-core too (its indexed-dataset writer), and every package
may import ``data``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import warnings

ENV_SHOW_ALL = "NOSA_THIRD_PARTY_WARNINGS"
# warnings.warn messages (any category) of megatron-core / torch that need no action
MISSING_ACCELERATORS = re.compile(r"(Transformer Engine and Apex are|Apex is|Transformer Engine is) not installed")
DEPRECATIONS = re.compile("|".join([
    r"full scope is deprecated",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
    r"The argument order of load has been changed",
    r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a single",
    # a CPU training run: megatron-core's own calls and modules, not the user's code
    r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
    r"MimoModelConfig is experimental",
    r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
    # a single-process tool (eval, converters): megatron-core's rank lookup before any process group
    r"Could not determine rank from torch\.distributed, RANK, or SLURM_PROCID",
]))
# advice for GPUs that megatron-core gives on a CPU too (tensor parallelism, per rank): dropped where CUDA is absent
CUDA_ONLY = re.compile(r"recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS")
# logging records (logger name -> message) of the same kind
LOGGED = {
    "megatron.core.models.gpt.gpt_model": re.compile(r"GPTModel IS DEPRECATED"),
    "megatron.core.dist_checkpointing.strategies.torch": re.compile(r"MCore's async save is deprecated"),
    "torch.utils.cpp_extension": re.compile(r"No CUDA runtime is found"),
    # the trainer builds DDP without megatron's precomputed layout: DDP computes the same layout itself
    "megatron.core.distributed.distributed_data_parallel": re.compile(r"full_param_layout not provided"),
}
OPTIONAL = {"transformer_engine": "Transformer Engine", "apex": "Apex"}

_state = {"installed": False, "noted": False, "stream": None}


def missing_optional() -> list[str]:
    """Names of the optional accelerator packages that are not installed."""
    return [name for mod, name in OPTIONAL.items() if importlib.util.find_spec(mod) is None]


def note_line() -> str:
    missing = missing_optional() or ["Transformer Engine / Apex features"]
    return (f"note: optional packages not installed: {', '.join(missing)} (megatron-core runs its PyTorch "
            f"fallbacks)")


def _without_cuda() -> bool:
    """torch is loaded and sees no CUDA device (the warning came from megatron-core, which imports torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and not torch.cuda.is_available()


def _note_once() -> None:
    if _state["noted"]:
        return
    _state["noted"] = True
    if int(os.environ.get("RANK", "0")) == 0:
        print(note_line(), file=_state["stream"] or sys.stdout, flush=True)


class _DropKnown(logging.Filter):
    def __init__(self, pattern: re.Pattern) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def quiet_third_party(note_stream=None) -> None:
    """Install the filters (idempotent; a no-op with ``NOSA_THIRD_PARTY_WARNINGS=1``); the note goes to
    ``note_stream`` (default stdout; a program whose stdout is data, e.g. JSON, passes ``sys.stderr``)."""
    _state["stream"] = note_stream
    if _state["installed"] or os.environ.get(ENV_SHOW_ALL, "") not in ("", "0"):
        return
    _state["installed"] = True
    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if MISSING_ACCELERATORS.search(text):
            _note_once()
        elif not DEPRECATIONS.search(text) and not (CUDA_ONLY.search(text) and _without_cuda()):
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    for name, pattern in LOGGED.items():
        logging.getLogger(name).addFilter(_DropKnown(pattern))
