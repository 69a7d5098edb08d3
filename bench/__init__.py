"""Benchmarks of NOSA training and inference, run from the repository root as ``python -m bench.<name>``.

- ``attention``: the NOSA Triton attention kernels against dense cuDNN SDPA and FlexAttention;
- ``train_throughput``: end-to-end training tokens/s of the trainer (NOSA against dense) on GPUs;
- ``inference``: the exported model's prefill, decode and offloaded decode against a stock Llama;
- ``speed_report``: one table of the speed targets from the benchmarks' JSON files (or measuring first).

Helpers: ``gpu_clocks`` (GPU clocks while a run is timed), ``host_timing`` (host and GPU time of a call),
``memory_trace`` (peak device memory by allocating line). Developers' probes: ``bench/probes/``.
"""
