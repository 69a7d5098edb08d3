"""The one place that lets megatron-core run on a CPU-only machine under gloo.

megatron-core assumes CUDA in a few dozen places (``torch.cuda.current_device()``, ``device="cuda"``
tensor factories, CUDA RNG tracker, ``torch.cuda.current_stream()``, ``Tensor.type()`` checks for
``torch.cuda.FloatTensor``). :func:`apply_cpu_shim` redirects exactly those to the CPU (the
numbered items below: 1. current device, 2. the stock causal mask, 3. the RNG tracker, 4. device
factories, 5. synchronisation, 6. type checks, 7. streams). It is a no-op when CUDA is available,
so GPU runs never see it. Call it once, before building models, in CPU tests and the CPU demo.
:func:`lean_megatron_import` (called where a command starts) makes megatron-core's import on a CPU
skip its GPU-only compile machinery.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import logging
import sys

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_APPLIED = False
_MODE: TorchFunctionMode | None = None
_ORIGINALS: list = []  # (owner, attribute, value before the shim), for remove_cpu_shim


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` to cpu, ``.cuda()`` to identity and reports CPU tensors as
    ``torch.cuda.*Tensor`` in ``Tensor.type()`` (megatron's optimizer asserts on it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _NullStream:
    """Stand-in for ``torch.cuda.Stream``: every synchronisation is a no-op on CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def record_event(self, *args, **kwargs):
        return None


def cpu_shim_needed() -> bool:
    """True when there is no usable CUDA device (the shim is only ever applied then)."""
    return not torch.cuda.is_available()


def apply_cpu_shim(force: bool = False) -> bool:
    """Patch torch/megatron-core for CPU + gloo. Idempotent.

    Returns True if the shim is active after the call. Without ``force`` it does nothing when
    CUDA is available.
    """
    global _APPLIED, _MODE
    if _APPLIED:
        return True
    if not force and not cpu_shim_needed():
        return False

    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel.random as mrandom

    patches = [
        # 1. torch.cuda.current_device() is used for device placement all over megatron-core.
        (torch.cuda, "current_device", lambda: torch.device("cpu")),
        # 3. The model-parallel RNG tracker stores/restores CUDA RNG states: use the CPU generator.
        (torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state()),
        (torch.cuda, "set_rng_state", lambda state, device="cuda": torch.set_rng_state(state)),
        (torch.cuda, "manual_seed", torch.manual_seed),
        (mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
        (mrandom, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
        # 2. stock DotProductAttention builds its causal mask on "cuda".
        (fused_softmax, "get_default_causal_mask", lambda sq: torch.ones(sq, sq, dtype=torch.bool).triu(1)),
        # 5. + 7. synchronisation and streams.
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch.cuda, "current_stream", lambda *a, **k: _NullStream()),
        (torch.cuda, "default_stream", lambda *a, **k: _NullStream()),
        (torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext()),
        (torch.cuda, "Stream", _NullStream),
    ]
    for owner, name, value in patches:
        _ORIGINALS.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)
    # 4. + 6. device="cuda" factories, .cuda(), .to("cuda"), Tensor.type() checks.
    _MODE = _CudaToCpu()
    _MODE.__enter__()
    _APPLIED = True
    logger.info("runtime.megatron_cpu: megatron-core patched for CPU/gloo")
    return True


def remove_cpu_shim() -> None:
    """Undo :func:`apply_cpu_shim` (a no-op when it is not applied): for a process that trains in-process
    and then goes on with other work, e.g. a test runner."""
    global _APPLIED, _MODE
    if not _APPLIED:
        return
    _MODE.__exit__(None, None, None)
    _MODE = None
    while _ORIGINALS:
        owner, name, value = _ORIGINALS.pop()
        setattr(owner, name, value)
    _APPLIED = False


def _no_compile(model=None, **kwargs):
    """``torch.compile`` as megatron-core's fused ops see it on a CPU: the function itself (they run
    unfused there anyway), so importing them builds no dynamo / inductor machinery."""
    return model if model is not None else (lambda fn: fn)


class _LeanMegatronImport(importlib.abc.MetaPathFinder):
    """Runs the first import of ``megatron.core`` with ``torch.compile`` as :func:`_no_compile` and
    ``wandb`` (which ``megatron.core.timers`` imports) loaded lazily, on first use."""

    def find_spec(self, name, path, target=None):
        if name != "megatron.core":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            _lazy_module("wandb")
            real, torch.compile = torch.compile, _no_compile
            try:
                run(module)
            finally:
                torch.compile = real

        spec.loader.exec_module = exec_module
        return spec


def _lazy_module(name: str) -> None:
    """Put ``name`` in ``sys.modules`` as a module that executes on its first attribute access."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        return
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def lean_megatron_import() -> bool:
    """On a CPU-only machine, make this process's first ``import megatron.core`` skip what only GPU
    runs use (about half of its import time: the compile machinery behind megatron-core's fused ops,
    and wandb until something uses it). A no-op with CUDA, or once megatron-core is imported."""
    if not cpu_shim_needed() or "megatron.core" in sys.modules:
        return False
    if not any(isinstance(f, _LeanMegatronImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _LeanMegatronImport())
    return True
