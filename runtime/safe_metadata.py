"""Reading torch distributed-checkpoint ``.metadata`` files without running code from them.

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle``, so a
crafted checkpoint could run any code on resume, ``init_from`` or conversion.
:func:`install_safe_metadata_reader` (idempotent) makes that one method use
:class:`MetadataUnpickler`, which resolves only the classes a checkpoint's metadata is made of
(``torch.distributed.checkpoint`` metadata and save-plan dataclasses, ``torch.Size``, dtypes,
layouts, memory formats); anything else (``os.system``, ``builtins.eval``, ...) raises
``UnpicklingError`` before it is called.
"""

from __future__ import annotations

import pickle

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
}


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals in :data:`ALLOWED`."""

    def find_class(self, module: str, name: str):
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which checkpoint metadata "
                                     f"never contains: refusing to load it (crafted or foreign file)")


_INSTALLED = False


def install_safe_metadata_reader() -> None:
    """Route ``torch.distributed.checkpoint.FileSystemReader.read_metadata`` through :class:`MetadataUnpickler`."""
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
    _INSTALLED = True
