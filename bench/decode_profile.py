"""One NOSA decode step, layer by layer (``bench.inference --profile`` with decode rows).

``step_profile(model, cache, tok, device)`` profiles one eager step of the plain decode body under
``torch.profiler`` with a range per decoder layer and per part of a layer's NOSA step (``eviction_head``:
the new token's score; ``window_update``: the ring / compressed-key writes; ``selection``:
``select_decode_fast``, or the selection kernel with the Triton attention; ``attention``: the token's store
and the attention over its blocks; ``other``: norms, projections, RoPE, MLP, the step's position masks). The
unit is a device kernel on CUDA (its device time) and on a CPU an innermost ATen compute op (views and
allocations left out; its CPU time). The captured CUDA graph replays the same kernels without their launch
cost. Then one eager step of the ``torch.compile``-d body (Inductor; ``aot_eager`` on a CPU; no graph): its
kernels, to compare counts.

Returns ``profile_step`` (units, time, host synchronisations), ``profile_sections`` (per part, all layers),
``profile_layers`` (per layer: units, time, the selection's share) and ``profile_layer_table`` (the kernels
of one NOSA layer: name, count, time, share of the layer), ``profile_compiled`` (the compiled step's units
and its 20 largest kernels).
"""

from __future__ import annotations

import importlib
from collections import defaultdict

import torch

from bench.inference_util import cache_kw, log, out_cache

SECTIONS = ("eviction_head", "window_update", "selection", "attention")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")


# ATen ops that launch no kernel (views, allocation, metadata): not counted as units on a CPU
NOT_KERNELS = frozenset(f"aten::{n}" for n in (
    "as_strided", "empty", "empty_strided", "empty_like", "view", "_reshape_alias", "_unsafe_view", "reshape",
    "resize_", "resolve_conj", "resolve_neg", "promote_types", "to", "_to_copy", "expand", "slice", "select",
    "t", "transpose", "unsqueeze", "squeeze", "alias", "detach", "lift_fresh", "result_type", "permute",
    "contiguous", "unbind", "split", "chunk", "narrow", "size", "stride", "is_nonzero", "_local_scalar_dense",
    "scalar_tensor", "numpy_T", "matrix_H", "view_as", "expand_as", "flatten", "unflatten", "movedim", "diagonal",
    "item"))


def _is_kernel(ev) -> bool:
    return ev.name.startswith("aten::") and ev.name not in NOT_KERNELS


def _innermost_kernel(ev) -> bool:
    """A CPU op that would be a kernel: an ATen compute op with no compute op below it."""
    if not _is_kernel(ev):
        return False
    todo = list(ev.cpu_children)
    while todo:
        c = todo.pop()
        if _is_kernel(c):
            return False
        todo.extend(c.cpu_children)
    return True


def _ranged(name: str, fn):
    def wrapped(*a, **kw):
        with torch.profiler.record_function(name):
            return fn(*a, **kw)
    return wrapped


class _Ranges:
    """Profiler ranges around each decoder layer and the parts of its NOSA step (restored on exit)."""

    def __init__(self, model) -> None:
        self.model = model
        self.step = importlib.import_module(type(model).__module__.rsplit(".", 1)[0] + ".nosa_decode_step")
        self.saved: list = []

    def __enter__(self):
        for i, layer in enumerate(self.model.model.layers):
            self.saved.append((layer, "forward", layer.__dict__.get("forward")))
            layer.forward = _ranged(f"layer{i:03d}", layer.forward)
            attn = layer.self_attn
            self.saved.append((attn, "_new_token_scores", attn.__dict__.get("_new_token_scores")))
            attn._new_token_scores = _ranged("eviction_head", attn._new_token_scores)
        for fn, name in (("_update_windows", "window_update"), ("select_decode_fast", "selection"),
                         ("select_decode_kernel", "selection"), ("_attend_in_place", "attention"),
                         ("_attend_gathered", "attention")):
            self.saved.append((self.step, fn, getattr(self.step, fn)))
            setattr(self.step, fn, _ranged(name, getattr(self.step, fn)))
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, old in reversed(self.saved):
            if obj is self.step:
                setattr(obj, name, old)
            elif old is None:
                del obj.__dict__[name]
            else:
                obj.__dict__[name] = old


def _units(prof, on_cuda: bool) -> list:
    """``(name, microseconds, enclosing range names)`` of each kernel (CUDA) or innermost ATen compute op (CPU)."""
    out = []
    for ev in prof.events():
        if on_cuda:
            items = [(k.name, k.duration) for k in getattr(ev, "kernels", [])] if ev.device_type.name == "CPU" \
                else []
        else:
            items = [(ev.name, ev.cpu_time_total)] if _innermost_kernel(ev) else []
        if not items:
            continue
        ranges, p = [], ev.cpu_parent
        while p is not None:
            ranges.append(p.name)
            p = p.cpu_parent
        out += [(n, float(us), ranges) for n, us in items]
    return out


def _syncs(prof) -> int:
    return sum(1 for ev in prof.events() if ev.name in SYNC_CALLS)


def _one_step(model, cache, tok, on_cuda: bool):
    from torch.profiler import ProfilerActivity, profile

    name = cache_kw(model)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=acts) as prof:
        out = model(tok, use_cache=True, **{name: cache})
        if on_cuda:
            torch.cuda.synchronize()
    return prof, out_cache(out), out.logits[:, -1:].argmax(-1)


@torch.no_grad()
def step_profile(model, cache, tok, device, warm: int = 2, top: int = 20) -> dict:
    """The per-layer profile of one decode step of ``model`` on ``cache`` (see the module docstring)."""
    on_cuda = torch.device(device).type == "cuda"
    opts = dict(model.model.cache_options)
    name = cache_kw(model)
    try:
        model.model.cache_options = {**opts, "cuda_graphs": False, "compile": False}
        for _ in range(warm):
            out = model(tok, use_cache=True, **{name: cache})
            cache, tok = out_cache(out), out.logits[:, -1:].argmax(-1)
        with _Ranges(model):
            prof, cache, tok = _one_step(model, cache, tok, on_cuda)
        units = _units(prof, on_cuda)
        syncs = _syncs(prof)
        compiled = None
        try:
            backend = True if on_cuda else "aot_eager"  # Inductor on CUDA; a CPU (smoke test) traces only
            model.model.cache_options = {**opts, "cuda_graphs": False, "compile": backend}
            for _ in range(warm):  # compiles (once per shape)
                out = model(tok, use_cache=True, **{name: cache})
                cache, tok = out_cache(out), out.logits[:, -1:].argmax(-1)
            if model.model.cache_options.get("compile") == backend:  # no fallback to the plain body
                cprof, cache, tok = _one_step(model, cache, tok, on_cuda)
                compiled = (_units(cprof, on_cuda), _syncs(cprof))
        except Exception as e:  # noqa: BLE001 (the eager table is still worth reporting)
            log(f"  compiled step not profiled: {type(e).__name__}: {e}")
    finally:
        model.model.cache_options = opts
    return summarize(units, syncs, compiled, len(model.model.layers), top)


def summarize(units: list, syncs: int, compiled, num_layers: int, top: int = 20) -> dict:
    """The tables of :func:`step_profile` from its units (``(name, us, ranges)``)."""
    total = sum(us for _, us, _ in units) or 1.0
    per_layer = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))  # layer -> section -> [count, us]
    kernels = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))  # layer -> (section, name) -> [count, us]
    outside = [0, 0.0]
    for name, us, ranges in units:
        layer = next((int(r[5:]) for r in ranges if r.startswith("layer") and r[5:].isdigit()), None)
        if layer is None:
            outside[0] += 1
            outside[1] += us
            continue
        section = next((r for r in ranges if r in SECTIONS), "other")
        per_layer[layer][section][0] += 1
        per_layer[layer][section][1] += us
        kernels[layer][(section, name[:80])][0] += 1
        kernels[layer][(section, name[:80])][1] += us
    layers = []
    for i in range(num_layers):
        secs = per_layer.get(i, {})
        n = sum(c for c, _ in secs.values())
        t = sum(u for _, u in secs.values())
        sel = secs.get("selection", [0, 0.0])
        layers.append({"layer": i, "units": n, "us": round(t, 1), "selection_units": sel[0],
                       "selection_us": round(sel[1], 1), "selection_share": round(sel[1] / t, 3) if t else 0.0})
    sections = {}
    for s in (*SECTIONS, "other"):
        c = sum(per_layer[i][s][0] for i in per_layer if s in per_layer[i])
        u = sum(per_layer[i][s][1] for i in per_layer if s in per_layer[i])
        sections[s] = {"units": c, "us": round(u, 1), "share": round(u / total, 3)}
    sections["outside_layers"] = {"units": outside[0], "us": round(outside[1], 1),
                                  "share": round(outside[1] / total, 3)}
    # the kernels of one NOSA layer (the first with a selection), largest first
    rep = next((i for i in sorted(kernels) if any(s == "selection" for s, _ in kernels[i])), min(kernels, default=None))
    table = []
    if rep is not None:
        lt = sum(u for _, u in kernels[rep].values()) or 1.0
        table = [{"section": s, "name": n, "count": c, "us": round(u, 2), "share": round(u / lt, 3)}
                 for (s, n), (c, u) in sorted(kernels[rep].items(), key=lambda kv: -kv[1][1])]
    out = {"profile_step": {"units": len(units), "us": round(total, 1), "host_syncs": syncs,
                            "units_per_layer": round(sum(r["units"] for r in layers) / max(1, num_layers), 1)},
           "profile_sections": sections, "profile_layers": layers, "profile_layer": rep,
           "profile_layer_table": table}
    if compiled is not None:
        cu, cs = compiled
        agg = defaultdict(lambda: [0, 0.0])
        for n, us, _ in cu:
            agg[n[:80]][0] += 1
            agg[n[:80]][1] += us
        ct = sum(us for _, us, _ in cu) or 1.0
        out["profile_compiled"] = {
            "units": len(cu), "us": round(ct, 1), "host_syncs": cs, "units_per_layer": round(len(cu) / num_layers, 1),
            "top": [{"name": n, "count": c, "us": round(u, 2), "share": round(u / ct, 3)}
                    for n, (c, u) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]]}
    print_profile(out)
    return out


def print_profile(p: dict) -> None:
    st = p["profile_step"]
    log(f"  one step (eager, plain body): {st['units']} units, {st['us']:.1f} us, {st['units_per_layer']} units "
        f"per layer, {st['host_syncs']} host syncs")
    for s, v in p["profile_sections"].items():
        log(f"    {s:15s} {v['units']:6d} units {v['us']:10.1f} us {100 * v['share']:5.1f} %")
    log("    layer  units        us  selection units / us / share")
    for r in p["profile_layers"]:
        log(f"    {r['layer']:5d} {r['units']:6d} {r['us']:9.1f}  {r['selection_units']:4d} {r['selection_us']:9.1f} "
            f"{100 * r['selection_share']:5.1f} %")
    log(f"    layer {p['profile_layer']}, by kernel / op:")
    for r in p["profile_layer_table"]:
        log(f"      {r['section']:13s} {r['count']:4d} {r['us']:9.2f} us {100 * r['share']:5.1f} %  {r['name']}")
    c = p.get("profile_compiled")
    if c:
        log(f"  one step (eager, compiled body): {c['units']} units ({c['units_per_layer']} per layer), "
            f"{c['us']:.1f} us, {c['host_syncs']} host syncs; largest:")
        for r in c["top"]:
            log(f"      {r['count']:4d} {r['us']:9.2f} us {100 * r['share']:5.1f} %  {r['name']}")
