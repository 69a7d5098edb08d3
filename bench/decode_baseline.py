"""The fast stock-Llama decode that transformers documents: a static KV cache and ``torch.compile``.

``static_decode(model, prompt, steps, compiled)`` prefills ``prompt`` ``[B, n]`` eagerly into a
``StaticCache`` of ``n + steps + 8`` positions, then times ``steps`` greedy decode steps of
``model.forward`` compiled with ``mode="reduce-overhead"`` (CUDA graphs; ``compiled=False``: the same
static cache, eager); a model whose forward has a data-dependent branch (transformers' LongRoPE compares
the length with the original context every call) has that choice made once when the prompt is already
past the original context (every step then takes the long factors: ``rope: "pinned_long"`` in the row,
exact), else compiles with graph breaks where its transformers version does not trace the choice
(``fullgraph: false`` in the row). The first steps after compiling are warm-up (compilation, graph
capture) and not timed. Returns tokens/s and ms per step like ``bench.inference``'s decode rows.
"""

from __future__ import annotations

import inspect
import time

import torch

WARM_STEPS = 3  # compile + CUDA-graph capture + one replay


def static_cache(model, batch: int, max_len: int, device: torch.device, dtype: torch.dtype):
    """A transformers ``StaticCache`` for ``batch`` sequences of ``max_len`` positions, whatever the
    installed transformers asks for (5.x sizes it lazily; 4.x takes the batch, device and dtype)."""
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kw = {"config": model.config, "max_cache_len": max_len}
    for name, value in (("max_batch_size", batch), ("batch_size", batch), ("device", device), ("dtype", dtype)):
        if name in params:
            kw[name] = value
    return StaticCache(**kw)


def pin_longrope(model, prompt_len: int) -> str | None:
    """After a prefill of ``prompt_len`` tokens, fix a LongRoPE rotary embedding to the frequencies it uses
    from then on when every later position is past the original context (the long factors, which the
    prefill put in ``inv_freq``): the per-call length check then leaves the compiled step. Returns
    ``"pinned_long"`` when pinned, None when the model has no LongRoPE or the prompt is within the original
    context (the check stays: a decode may cross the boundary)."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", None) != "longrope":
        return None
    rope = getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling", None) or {}
    original = rope.get("original_max_position_embeddings") or getattr(
        model.config, "original_max_position_embeddings", None)
    if original is None or prompt_len <= original:
        return None
    rotary.rope_type = "pinned_long"  # neither "dynamic" nor "longrope": the update hook returns at once
    return "pinned_long"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def static_decode(model, prompt: torch.Tensor, steps: int, compiled: bool = True) -> dict:
    """Greedy decode of ``steps`` tokens after ``prompt`` with a static cache (compiled forward)."""
    device, dtype = prompt.device, next(model.parameters()).dtype
    B, n = prompt.shape
    cache = static_cache(model, B, n + steps + WARM_STEPS + 8, device, dtype)
    out = model(prompt, past_key_values=cache, use_cache=True, cache_position=torch.arange(n, device=device),
                logits_to_keep=1)
    tok = out.logits[:, -1:].argmax(-1)
    rope = pin_longrope(model, n)
    try:
        return _timed_steps(model, cache, tok, n, steps, compiled, rope)
    finally:
        if rope:  # the next row's prompt may be within the original context: the check comes back
            model.model.rotary_emb.rope_type = "longrope"


def _timed_steps(model, cache, tok, n: int, steps: int, compiled: bool, rope: str | None) -> dict:
    device = tok.device
    B = tok.shape[0]
    fullgraph = compiled
    if compiled:  # a fresh compile per row: rows of other shapes must not exhaust the recompile limit (eager then)
        torch._dynamo.reset()
    step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if compiled else model.forward
    pos = torch.tensor([n], device=device)
    times = []
    for i in range(WARM_STEPS + steps):
        _sync(device)
        t0 = time.perf_counter()
        try:
            out = step(tok, past_key_values=cache, use_cache=True, cache_position=pos)
        except torch._dynamo.exc.Unsupported:  # e.g. LongRoPE's length check: compile around it (graph break)
            if not fullgraph or i:
                raise
            fullgraph = False
            step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
            out = step(tok, past_key_values=cache, use_cache=True, cache_position=pos)
        tok = out.logits[:, -1:].argmax(-1).clone()  # the graph's output buffer is reused by the next replay
        pos = pos + 1
        _sync(device)
        if i >= WARM_STEPS:
            times.append(time.perf_counter() - t0)
    total = sum(times)
    return {"batch": B, "steps": steps, "step_ms": round(1e3 * total / steps, 3),
            "tok_per_s": round(B * steps / total, 1), "cache": "static", "compiled": compiled, "fullgraph": fullgraph,
            **({"rope": rope} if rope else {})}
