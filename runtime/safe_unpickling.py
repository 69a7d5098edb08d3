"""Loading torch distributed checkpoints without running code from them.

torch unpickles two things of a checkpoint with plain ``pickle``: the ``.metadata`` file
(``FileSystemReader.read_metadata``) and every non-tensor item (``DefaultLoadPlanner.load_bytes``,
``torch.load(weights_only=False)``: megatron's common state, RNG states, extra states), so a
crafted checkpoint could run any code on resume, ``init_from`` or conversion.
:func:`install_safe_checkpoint_loading` (idempotent) replaces exactly these two methods:
``.metadata`` is read with :class:`MetadataUnpickler`, which resolves only the classes checkpoint
metadata is made of (``torch.distributed.checkpoint`` metadata and save-plan dataclasses,
``torch.Size``, dtypes, layouts, memory formats), items with ``torch.load(weights_only=True)``
plus the NumPy types of an RNG state. Anything else (``os.system``, ``builtins.eval``, ...)
raises ``UnpicklingError`` before it is called.
"""

from __future__ import annotations

import pickle
import re

_DTYPES = {"float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "uint16",
           "uint32", "uint64", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"}
ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "megatron.core.dist_checkpointing.strategies.torch": {"MCoreSavePlan"},
    "torch.serialization": {"_get_layout"},  # looks a torch.layout up by its name
    "torch": {"Size", *_DTYPES},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # StorageMeta.checkpoint_id of plain torch saves
}


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals in :data:`ALLOWED`."""

    def find_class(self, module: str, name: str):
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which checkpoint metadata "
                                     f"never contains: refusing to load it (crafted or foreign file)")


_INSTALLED = False


def install_safe_checkpoint_loading() -> None:
    """Route ``.metadata`` through :class:`MetadataUnpickler` and checkpoint items through ``weights_only``."""
    global _INSTALLED
    if _INSTALLED:
        return
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.metadata import StorageMeta

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    filesystem.FileSystemReader.read_metadata = read_metadata
    _install_safe_bytes_loading()
    _INSTALLED = True


def _install_safe_bytes_loading() -> None:
    """Non-tensor items (megatron's common state, RNG states, TE extra state) are ``torch.save`` bytes
    that torch's ``DefaultLoadPlanner.load_bytes`` reads with ``weights_only=False`` (any code).
    Read them with ``weights_only=True`` instead, allowing the NumPy RNG state's types and
    ``io.BytesIO`` (megatron wraps its common state in one and loads that ``weights_only`` itself)."""
    import io

    import numpy as np
    import torch
    from torch.distributed.checkpoint import default_planner
    from torch.distributed.checkpoint._nested_dict import set_element

    core = getattr(np, "_core", None) or np.core  # numpy 2 / 1
    allowed = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), core.multiarray._reconstruct, io.BytesIO]

    def safe_load(value):
        value.seek(0)
        with torch.serialization.safe_globals(allowed):
            try:
                return torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                found = re.search(r"GLOBAL (\S+)", str(e))
                what = found.group(1) if found else "code"
                raise pickle.UnpicklingError(f"a checkpoint object refers to {what}, which checkpoints never "
                                             f"contain: refusing to load it (crafted or foreign file)") from None

    def load_bytes(self, read_item, value) -> None:
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], safe_load(value))
        else:
            self.state_dict[read_item.dest_index.fqn] = safe_load(value)

    default_planner.DefaultLoadPlanner.load_bytes = load_bytes


def read_checkpoint_metadata(ckpt) -> object:
    """The ``.metadata`` of a checkpoint dir through :class:`MetadataUnpickler`. Call before a load:
    torch's loader retries a refused file as rank-local metadata and logs both tracebacks."""
    from torch.distributed.checkpoint import FileSystemReader

    install_safe_checkpoint_loading()
    return FileSystemReader(str(ckpt)).read_metadata()


def load_error_line(e: BaseException) -> str:
    """One line for a failed checkpoint load: the first rank's root cause inside torch's
    ``CheckpointException`` (a ``BaseException`` whose text is a whole traceback), else ``e``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return load_error_line(first[0] if isinstance(first, tuple) else first)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
