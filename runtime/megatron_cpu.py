"""The one place that lets megatron-core run on a CPU-only machine under gloo.

megatron-core assumes CUDA in a few dozen places (``torch.cuda.current_device()``, ``device="cuda"``
tensor factories, CUDA RNG tracker, ``torch.cuda.current_stream()``, ``Tensor.type()`` checks for
``torch.cuda.FloatTensor``). :func:`apply_cpu_shim` redirects exactly those to the CPU (the
numbered items below: 1. current device, 2. the stock causal mask, 3. the RNG tracker, 4. device
factories, 5. synchronisation, 6. type checks, 7. streams, 8. the dist-checkpoint write-results
queue). It is a no-op when CUDA is available, so GPU runs never see it. Call it once, before
building models, in CPU tests and the CPU demo. :func:`lean_megatron_import` (called where a
command starts) makes megatron-core's import on a CPU skip its GPU-only compile machinery and
wandb, and torch's optimizers skip their ``torch._dynamo`` import.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import logging
import os
import queue
import sys
import threading
import types

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


class _LocalResultsQueue(queue.Queue):
    """megatron-core's dist-checkpoint write-results queue for synchronous saves, whose writer threads run
    in the saving process. An asynchronous save (a forked writer process) would need the manager-served
    queue: a put from another process fails loudly instead of losing the results."""

    def __init__(self):
        super().__init__()
        self._pid = os.getpid()

    def put(self, item, block=True, timeout=None):
        if os.getpid() != self._pid:
            raise RuntimeError("runtime.megatron_cpu: asynchronous dist-checkpoint saves are not supported on "
                               "the CPU (write results would not reach the saving process)")
        super().put(item, block, timeout)


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
    # 8. dist-checkpoint write results: a process-local queue instead of one served by a spawned manager
    # process (a fresh interpreter that imports torch to unpickle the results: ~2 CPU-s per saving process).
    import megatron.core.dist_checkpointing.strategies.filesystem_async as filesystem_async

    if filesystem_async._results_queue is None:
        patches.append((filesystem_async, "_results_queue", _LocalResultsQueue()))
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


class _LazyModule(types.ModuleType):
    """A module whose code runs on the first access to an attribute it does not have yet. Its import
    metadata (``__name__``, ``__file__``, ``__spec__``, ``__loader__``) is there from the start, so what
    scans ``sys.modules`` for it (``inspect.getmodule``: torch's operator registrations call it at import)
    does not load the module; ``__path__`` (a submodule import) loads it first, as a normal import would."""

    def __getattr__(self, attr):
        with _LAZY_LOCK:
            if type(self) is _LazyModule:  # not loaded yet (another thread may have just done it)
                spec = self.__spec__
                self.__class__ = types.ModuleType
                if spec.submodule_search_locations is not None:
                    self.__path__ = spec.submodule_search_locations
                spec.loader.exec_module(self)
        return getattr(self, attr)


_LAZY_LOCK = threading.RLock()


def _lazy_module(name: str) -> None:
    """Put ``name`` in ``sys.modules`` as a :class:`_LazyModule`: it executes on first use."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    module.__dict__.pop("__path__", None)
    module.__class__ = _LazyModule
    sys.modules[name] = module


def _dynamo_disable_on_demand(fn, recursive: bool):
    """What a ``torch._disable_dynamo`` wrapper calls for ``fn``: ``fn`` itself while ``torch._dynamo``
    is not imported (nothing can be tracing then), ``torch._dynamo.disable(fn)`` from then on."""

    def call(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        import torch._dynamo

        disabled = torch._dynamo.disable(fn, recursive, wrapping=False)
        fn.__dynamo_disable = disabled  # the wrapper's cache: later calls go straight to it
        return disabled(*args, **kwargs)

    return call


def _step_without_dynamo_import(use_grad):
    """An optimizer's ``step`` as torch's ``_use_grad_for_differentiable`` wrapper ``use_grad`` runs it,
    minus its ``torch._dynamo`` import while dynamo is not imported: the wrapper's graph breaks are no-ops
    outside a trace and the grad mode is set and restored the same way. Once dynamo is imported it is
    ``use_grad`` itself."""
    func = use_grad.__wrapped__

    @functools.wraps(func)
    def step(*args, **kwargs):
        if "torch._dynamo" in sys.modules:
            return use_grad(*args, **kwargs)
        prev_grad = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(args[0].defaults["differentiable"])
            return func(*args, **kwargs)
        finally:
            torch.set_grad_enabled(prev_grad)

    step._dynamo_on_demand = use_grad
    return step


# what torch's ``_use_grad_for_differentiable`` wrapper refers to (the torch this mirrors)
_USE_GRAD_NAMES = {"Optimizer", "_dynamo", "cast", "defaults", "graph_break", "is_grad_enabled", "set_grad_enabled",
                   "torch._dynamo"}


def _optimizers_without_dynamo_import() -> int:
    """torch.optim's methods and update functions are wrapped by ``torch._disable_dynamo``, which imports
    ``torch._dynamo`` (about half a CPU-second) on their first call, to keep a compiler that may trace them
    out. Fill each wrapper's cache with :func:`_dynamo_disable_on_demand` so that the import happens only
    once something else has imported dynamo. Returns the number of wrappers seen."""
    import torch._compile
    import torch.optim.optimizer as optimizer_module

    wrapper_code = torch._compile._disable_dynamo(lambda: None).__code__
    use_grad_code = optimizer_module._use_grad_for_differentiable(lambda: None).__code__
    if wrapper_code.co_freevars != ("fn", "recursive") or set(use_grad_code.co_names) != _USE_GRAD_NAMES:
        return 0  # a torch whose wrappers differ from the ones mirrored here: leave them as they are
    seen: set[int] = set()
    count = 0

    def visit(obj, depth: int) -> None:
        nonlocal count
        if not isinstance(obj, types.FunctionType) or id(obj) in seen or depth > 2:
            return
        seen.add(id(obj))
        if obj.__code__ is wrapper_code:
            cells = dict(zip(obj.__code__.co_freevars, (c.cell_contents for c in obj.__closure__)))
            fn = cells["fn"]
            if getattr(fn, "__dynamo_disable", None) is None:
                fn.__dynamo_disable = _dynamo_disable_on_demand(fn, cells["recursive"])
            count += 1
            return
        for cell in obj.__closure__ or ():  # torch.optim's update functions hold the wrapper in a closure
            with contextlib.suppress(ValueError):  # an empty cell
                visit(cell.cell_contents, depth + 1)

    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torch.optim" or name.startswith("torch.optim.")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and getattr(vars(value).get("step"), "__code__", None) is use_grad_code:
                value.step = _step_without_dynamo_import(value.step)
                count += 1
            for obj in vars(value).values() if isinstance(value, type) else (value,):
                visit(obj, 0)
    return count


def lean_megatron_import() -> bool:
    """On a CPU-only machine, make this process's first ``import megatron.core`` skip what only GPU
    runs use (about half of its import time: the compile machinery behind megatron-core's fused ops,
    and wandb until something uses it), and torch's optimizers import ``torch._dynamo`` only once
    something else has. A no-op with CUDA; the import part a no-op once megatron-core is imported."""
    if not cpu_shim_needed():
        return False
    _optimizers_without_dynamo_import()
    if "megatron.core" in sys.modules:
        return False
    if not any(isinstance(f, _LeanMegatronImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _LeanMegatronImport())
    return True
