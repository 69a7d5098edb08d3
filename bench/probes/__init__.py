"""Probes: measurements that answer one question about the training step, run as ``python -m bench.probes.<name>``.

- ``ab_throughput``: is a change faster? It times two checkouts (or two settings) alternately on one machine;
- ``host_syncs``: where does a training step make the host wait for the GPU? Counted by Python call site;
- ``layer_host``: does the GPU wait for the host? One NOSA layer's host time against its GPU time, part by part.
"""
