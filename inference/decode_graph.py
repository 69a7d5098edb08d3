"""CUDA-graph capture of the batched decode step over a ``NOSABlockCache`` (GPU-resident, or offloaded
with the direct-access transfers); used only on CUDA devices."""

from __future__ import annotations

import torch
from torch import Tensor

from inference.streams import shared_streams


class DecodeGraph:
    """A CUDA graph of one batched decode step over a GPU-resident :class:`NOSABlockCache`.

    ``body(emb [B, 1, H], (cos, sin)) -> hidden [B, 1, H]`` runs every layer's decode step. The first
    step after the cache's buffers were (re)allocated runs eagerly on a side stream (the warm-up), the
    next one is captured (positions = the cache's lengths, advanced inside the graph by the new tokens'
    validity) and every later one replays it after copying the step's inputs into static buffers.
    The cache's ``version`` changes when it reallocates (growth, beam reordering): a new graph is made.
    """

    def __init__(self, cache) -> None:
        self.version = cache.version
        self.batch = cache.batch
        self.stream = shared_streams(cache.device, "graph", 1)[0]
        self.graph = None
        self.warm = False
        self.static: dict = {}
        self.out: Tensor | None = None
        self.compiled = False  # the captured body is torch.compile-d (set by the model)

    def step(self, cache, body, emb: Tensor, cos: Tensor, sin: Tensor, valid_new: Tensor) -> Tensor:
        cur = torch.cuda.current_stream()
        if not self.warm:
            self.stream.wait_stream(cur)
            with torch.cuda.stream(self.stream):
                cache.set_pos(cache.lens.clone())
                out = body(emb, (cos, sin))
                cache.lens += valid_new[:, 0].long()
            cur.wait_stream(self.stream)
            self.warm = True
            return out
        if self.graph is None:
            self.static = {"emb": emb.clone(), "cos": cos.clone(), "sin": sin.clone(), "valid": valid_new.clone()}
            cur.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream):
                cache.set_pos(cache.lens.clone())
                self.out = body(self.static["emb"], (self.static["cos"], self.static["sin"]))
                cache.lens += self.static["valid"][:, 0].long()
            self.graph = graph
        else:
            for name, t in (("emb", emb), ("cos", cos), ("sin", sin), ("valid", valid_new)):
                self.static[name].copy_(t)
        self.graph.replay()
        return self.out.clone()
