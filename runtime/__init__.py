"""Process plumbing shared by the applications (``train``, ``checkpoints_convert``, ``eval``).

Not NOSA layers: ``megatron_cpu`` (the CPU/gloo shim of megatron-core, applied only on CPU),
``megatron_compat`` (narrow fixes of megatron-core behaviour the trainer depends on),
``dataclass_io`` (the strict dict -> dataclass converter of recipes and saved configs),
``checkpoint_files`` (the layout of a run's checkpoint directory), ``outputs`` (files and directories
written whole or not at all) and ``cli`` (a command's bad input as one line).
"""
