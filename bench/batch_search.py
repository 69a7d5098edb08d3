"""The largest batch a decode cache fits under a device budget (``bench.inference``'s offload rows).

A mixin of ``bench.inference.Bench``: it uses the bench's ``prefilled_cache``, ``decode_rate``, ``free``,
``long`` context and ``args`` (``mem_limit_gib``, ``host_mem_limit_gib``).
"""

from __future__ import annotations

import torch

from bench.inference_util import GIB, log


class BatchSearch:
    def peak_bytes(self, model, cache) -> int:
        if self.dev.type == "cuda":
            return torch.cuda.max_memory_allocated()
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        held = cache.memory_bytes()["device"] if hasattr(cache, "memory_bytes") else sum(
            t.numel() * t.element_size() for layer in getattr(cache, "layers", []) for t in
            (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)
        return weights + held

    @torch.no_grad()
    def probe(self, model, batch: int, offload: bool) -> dict:
        """Peak device bytes of a batch at the long context (cache built, 2 decode steps)."""
        self.free()
        cache, tok = self.prefilled_cache(model, self.long, batch, offload=offload)
        if self.dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.decode_rate(model, cache, tok, steps=1, warm=1)
        held = cache.memory_bytes() if hasattr(cache, "memory_bytes") else {"device": 0, "host": 0}
        r = {"batch": batch, "peak_bytes": self.peak_bytes(model, cache), **held}
        del cache, tok
        return r

    def largest_batch(self, model, offload: bool) -> dict:
        """Largest batch whose peak stays under the device limit (and host limit when offloading)."""
        limit = int(self.args.mem_limit_gib * GIB)
        p1, p2 = self.probe(model, 1, offload), self.probe(model, 2, offload)
        slope = max(1, p2["peak_bytes"] - p1["peak_bytes"])
        guess = 1 + (limit - p1["peak_bytes"]) // slope
        host_cap = None
        if offload:
            host_cap = int(self.args.host_mem_limit_gib * GIB) // max(1, p2["host"] - p1["host"])
            guess = min(guess, host_cap)
        guess = max(1, int(guess))
        info = {"per_seq_device_mib": round(slope / 2**20, 1),
                "per_seq_cache_mib": round((p2["device"] - p1["device"]) / 2**20, 1),  # the rest: step buffers
                "base_device_gib": round((p1["peak_bytes"] - slope) / GIB, 2),
                "host_batch_cap": host_cap, "predicted": guess}
        fits = None
        for _ in range(4):
            try:
                p = self.probe(model, guess, offload)
                if p["peak_bytes"] <= limit:
                    fits = (guess, p)
                    break
                log(f"batch {guess}: peak {p['peak_bytes'] / GIB:.2f} GiB > limit; trying smaller")
            except torch.cuda.OutOfMemoryError:
                log(f"batch {guess}: out of memory; trying smaller")
            self.free()
            guess = max(1, int(guess * 0.9))
        if fits is None:
            raise RuntimeError("no batch fits under --mem-limit-gib")
        # the slope of batches 1 -> 2 can overstate the per-sequence cost (fixed step buffers): re-predict
        # from the slope up to the fitting batch and take a larger batch while it still fits; once a batch
        # does not fit, bisect between the largest that fits and it
        too_big = None
        for _ in range(12):
            B, p = fits
            if B < 2 or (host_cap is not None and B >= host_cap):
                break
            if too_big is None:
                nxt = 1 + (limit - p1["peak_bytes"]) * (B - 1) // max(1, p["peak_bytes"] - p1["peak_bytes"])
                nxt = min(int(nxt), host_cap) if host_cap is not None else int(nxt)
            else:
                nxt = (B + too_big) // 2
            if nxt <= B:
                break
            self.free()
            try:
                q = self.probe(model, nxt, offload)
            except torch.cuda.OutOfMemoryError:
                q = None
            if q is None or q["peak_bytes"] > limit:
                log(f"batch {nxt}: over the limit; the largest batch lies in [{B}, {nxt})")
                too_big = nxt
                continue
            fits = (nxt, q)
        B, p = fits
        info["per_seq_device_mib_at_batch"] = round((p["peak_bytes"] - p1["peak_bytes"]) / max(1, B - 1) / 2**20, 1)
        return {**info, "batch": B, "peak_gib": round(p["peak_bytes"] / GIB, 2), "host_gib": round(p["host"] / GIB, 2)}
