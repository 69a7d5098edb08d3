"""Checks and profiles of the NOSA decode step (``bench.inference``): the captured CUDA graph and the
offloaded cache against eager decode, the kernels of a step, and what a step allocates at its peak.

A mixin of ``bench.inference.Bench`` (uses its ``prefilled_cache``, ``decode_rate``, ``prompt``, ``free``,
``sync``, ``ctx``, ``long``, ``shape``, ``dev``).
"""

from __future__ import annotations

import torch

from bench import memory_trace
from bench.inference_util import cache_kw, log, out_cache


class DecodeChecks:
    @torch.no_grad()
    def kernel_profile(self, model, cache, tok, steps: int = 3) -> dict:
        """Device time per decode step by kernel (eager steps under ``torch.profiler``; the captured
        graph replays the same kernels): the 20 largest, in ms per step."""
        from torch.profiler import ProfilerActivity, profile

        graphs = model.model.cache_options.get("cuda_graphs", True)
        model.set_cache_options(cuda_graphs=False)
        name = cache_kw(model)
        try:
            for _ in range(2):
                out = model(tok, use_cache=True, **{name: cache})
                cache, tok = out_cache(out), out.logits[:, -1:].argmax(-1)
            self.sync()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.dev.type == "cuda" else [])
            with profile(activities=acts) as prof:
                for _ in range(steps):
                    out = model(tok, use_cache=True, **{name: cache})
                    cache, tok = out_cache(out), out.logits[:, -1:].argmax(-1)
                self.sync()
        finally:
            model.set_cache_options(cuda_graphs=graphs)
        rows = []
        for ev in prof.key_averages():
            t = (getattr(ev, "self_device_time_total", 0) or 0) if self.dev.type == "cuda" else ev.self_cpu_time_total
            if t > 0:
                rows.append((ev.key[:90], round(t / 1e3 / steps, 3), ev.count // steps))
        rows.sort(key=lambda r: -r[1])
        total = sum(r[1] for r in rows)
        return {"profile_total_ms_per_step": round(total, 3),
                "profile_top": [{"name": n, "ms_per_step": ms, "calls_per_step": c} for n, ms, c in rows[:20]]}

    @torch.no_grad()
    def graph_check(self, model, steps: int = 6) -> dict:
        """Max |logit difference| vs the eager GPU-resident decode (same fixed tokens) of the captured
        decode step and of the offloaded cache (its default transfer path, captured too when it can be)."""
        feed = self.prompt(steps, 4).T.reshape(steps, 4, 1)
        runs = []
        for graphs, offload in ((False, False), (True, False), (True, True)):
            model.set_cache_options(cuda_graphs=graphs)
            cache, _ = self.prefilled_cache(model, self.ctx[0], 4, offload=offload)
            logits = []
            for j in range(steps):
                out = model(feed[j], use_cache=True, **{cache_kw(model): cache})
                cache = out_cache(out)
                logits.append(out.logits[:, -1].float())
            runs.append(torch.stack(logits))
        model.set_cache_options()
        return {"max_abs_logit_diff": (runs[1] - runs[0]).abs().max().item(),
                "offload_max_abs_logit_diff": (runs[2] - runs[0]).abs().max().item(), "offload_fetch": cache.fetch,
                "logit_scale": round(runs[0].abs().max().item(), 3)}

    @torch.no_grad()
    def step_memory(self, model, batch: int, offload: bool, mode: str) -> dict:
        """Device memory at the peak of two decode steps (warm-up and capture) at ``batch``: the
        blocks live then, by the Python line that allocated them (``bench.memory_trace``). The
        history starts before the cache is built, so what the prefill and the batch repeat leave
        behind is listed next to the cache itself; ``step_*`` is what the steps add on top."""
        self.free()
        built = {}

        def run(mark):
            built["cache"], built["tok"] = self.prefilled_cache(model, self.long, batch, offload=offload)
            mark()
            built["allocated"] = torch.cuda.memory_allocated(self.dev)
            self.decode_rate(model, built["cache"], built["tok"], steps=1, warm=1)

        events, start = memory_trace.record(run, self.dev, marked=True)
        live_before, _ = memory_trace.peak_allocations(events[:start], start=start)
        peak, blocks = memory_trace.peak_allocations(events, start=start)
        step_peak, _ = memory_trace.peak_allocations(events[start:])
        cache_mib = built["cache"].memory_bytes()["device"] / 2**20
        sites = memory_trace.top_sites(blocks, 20)
        for s in sites:
            log(f"  {s['mib']:10.2f} MiB in {s['blocks']:5d} blocks  {s['site']}")
        # live before the steps and not the cache's tensors: what the build left behind
        other = live_before / 2**20 - cache_mib
        # allocated before the history started (weights, cuBLAS workspaces of the streams used so far, ...)
        weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if t.is_cuda)
        unrecorded = (built["allocated"] - live_before - weights) / 2**20
        log(f"  at the steps' start: {live_before / 2**20:.1f} MiB recorded live, cache {cache_mib:.1f} MiB, "
            f"other {other:.1f} MiB ({other / batch:.2f} MiB per sequence); allocated before the record, "
            f"not weights: {unrecorded:.1f} MiB")
        built.clear()  # the cache's device memory is released before the caller's next build
        return {"model": "nosa", "mode": mode, "batch": batch, "context": self.long,
                "step_peak_mib": round(step_peak / 2**20, 1),
                "step_peak_mib_per_seq": round(step_peak / 2**20 / batch, 2),
                "cache_mib": round(cache_mib, 1), "live_at_step_start_mib": round(live_before / 2**20, 1),
                "other_at_step_start_mib_per_seq": round(other / batch, 2),
                "allocated_before_record_not_weights_mib": round(unrecorded, 1),
                "peak_recorded_mib": round(peak / 2**20, 1), "peak_sites": sites}
