"""The attention benchmark, run as ``python -m bench.attention`` (``__main__.py``: what it measures, its
modes and arguments): the NOSA Triton attention kernels against dense cuDNN SDPA and FlexAttention.

``inputs`` (shapes, P1 lists, synthetic NOSA inputs), ``rows`` (timing and result rows), ``sweeps`` (launch
settings), ``selection`` (``--selection``), ``breakdown`` (``--packed``, ``--profile``, ``--index-profile``).
"""
