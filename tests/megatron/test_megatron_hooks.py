"""The private megatron-core seams ``nosa_layers/megatron/self_attention.py`` relies on.

megatron-core 0.19 has no public seam for four things NOSA needs, so the NOSA layer uses:

* ``Attention._checkpointed_attention_forward`` (overridden): under selective recompute it is the
  only place where the eviction score/bias can enter the checkpoint as tensor keyword arguments
  (``core_attention_extra_kwargs``) and where the selection can be prepared outside it;
* ``Attention._yarn_concentration_factor`` (set): the RoPE ``mscale`` that carries LongRoPE's
  attention factor into ``apply_rotary_pos_emb``;
* the eviction hand-off: ``get_query_key_value_tensors`` (overridden) computes the eviction outputs,
  which a forward pre-hook of the core attention adds to its keyword arguments; this relies on
  ``Attention.forward`` calling it before the core attention;
* ``rope_utils._apply_rotary_pos_emb_bshd`` (called): the sync-free packed RoPE passes
  ``rotary_pos_emb=None`` to ``Attention.forward`` (which then applies no RoPE) and applies this
  function itself, the one megatron's THD RoPE applies per document (hence bitwise equal).

A megatron-core upgrade that changes any of them fails here with the hook's name, instead of
silently training without the eviction bias or the LongRoPE factor.
"""

from __future__ import annotations

import inspect
import json
import sys
import types

from tests.megatron.conftest import REPO
from tests.subproc import run_logged

CHECKPOINTED = "_checkpointed_attention_forward"
YARN = "_yarn_concentration_factor"
QKV = "get_query_key_value_tensors"
CHECKPOINTED_PARAMS = ["self", "query", "key", "value", "attention_mask", "rotary_pos_emb", "attn_mask_type",
                       "attention_bias", "packed_seq_params", "core_attention_extra_kwargs"]
QKV_PARAMS = ["self", "hidden_states", "key_value_states", "output_gate", "split_qkv"]
BSHD = "_apply_rotary_pos_emb_bshd"
BSHD_PARAMS = ["t", "freqs", "rotary_interleaved", "mscale"]  # the ones the NOSA layer passes
FORWARD_KWARGS = ["rotary_pos_emb", "packed_seq_params", "inference_context", "inference_params"]


def hook_problems(attention_cls: type, self_attention_cls: type, rope_utils) -> list[str]:
    """One line per hook of ``Attention`` / ``SelfAttention`` / ``rope_utils`` that is missing or changed."""
    problems = []

    def need(ok: bool, hook: str, what: str) -> None:
        if not ok:
            problems.append(f"megatron-core hook {hook}: {what}")

    def params(fn) -> list[str]:
        return list(inspect.signature(fn).parameters) if fn is not None else []

    forward = inspect.getsource(attention_cls.forward)
    checkpointed = getattr(attention_cls, CHECKPOINTED, None)
    need(params(checkpointed) == CHECKPOINTED_PARAMS, CHECKPOINTED,
         f"parameters {params(checkpointed)}, expected {CHECKPOINTED_PARAMS}")
    if checkpointed is not None:
        src = inspect.getsource(checkpointed)
        need("torch.is_tensor" in src and "core_attention_extra_kwargs" in src, CHECKPOINTED,
             "no longer passes tensor core_attention_extra_kwargs through the checkpoint")
    need(f"self.{CHECKPOINTED}(" in forward, CHECKPOINTED, "Attention.forward no longer calls it")

    need(f"self.{YARN} =" in inspect.getsource(attention_cls.__init__), YARN, "Attention.__init__ no longer sets it")
    need(f"mscale=self.{YARN}" in forward, YARN, "Attention.forward no longer passes it as the RoPE mscale")

    qkv = getattr(self_attention_cls, QKV, None)
    need(params(qkv) == QKV_PARAMS, f"eviction hand-off ({QKV})", f"parameters {params(qkv)}, expected {QKV_PARAMS}")
    first = {name: forward.find(f"self.{name}") for name in (QKV, "core_attention", CHECKPOINTED)}
    need(-1 < first[QKV] < min(first["core_attention"], first[CHECKPOINTED]), f"eviction hand-off ({QKV})",
         "Attention.forward no longer computes q/k/v before running the core attention")

    bshd, thd = getattr(rope_utils, BSHD, None), getattr(rope_utils, "_apply_rotary_pos_emb_thd", None)
    need(set(BSHD_PARAMS) <= set(params(bshd)), BSHD, f"parameters {params(bshd)}, expected {BSHD_PARAMS}")
    need(thd is not None and f"{BSHD}(" in inspect.getsource(thd), BSHD,
         "megatron's THD RoPE no longer applies it per document")
    need(set(FORWARD_KWARGS) <= set(params(attention_cls.forward)), BSHD,
         f"Attention.forward parameters {params(attention_cls.forward)} lack one of {FORWARD_KWARGS}")
    need("if rotary_pos_emb is not None" in forward, BSHD,
         "Attention.forward no longer skips RoPE when rotary_pos_emb is None")
    return problems


SCRIPT = """
import json
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.attention import Attention, SelfAttention
from tests.megatron.test_megatron_hooks import hook_problems
print("HOOKS", json.dumps(hook_problems(Attention, SelfAttention, rope_utils)))
"""


def test_megatron_core_keeps_the_hooks_nosa_uses(tmp_path):
    log = tmp_path / "hooks.log"
    rc = run_logged([sys.executable, "-c", SCRIPT], log, 180, REPO)
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("HOOKS ")]
    assert rc == 0 and lines, log.read_text()[-3000:]
    problems = json.loads(lines[-1][len("HOOKS "):])
    assert not problems, "\n".join(problems)


def test_a_changed_hook_is_named():
    """The check itself: a megatron-core whose hooks moved is reported hook by hook."""

    class Attention:
        def __init__(self, config):
            self.concentration = 1.0

        def forward(self, hidden_states):
            out = self.core_attention(hidden_states)
            return self.get_query_key_value_tensors(out)

        def _checkpointed_attention_forward(self, query, key, value, attention_mask):
            return query

    class SelfAttention(Attention):
        def get_query_key_value_tensors(self, hidden_states, key_value_states=None):
            return hidden_states

    rope_utils = types.SimpleNamespace(_apply_rotary_pos_emb_bshd=lambda t, freqs, interleaved=False: t)
    problems = "\n".join(hook_problems(Attention, SelfAttention, rope_utils))
    for hook in (CHECKPOINTED, YARN, f"eviction hand-off ({QKV})", BSHD):
        assert f"megatron-core hook {hook}:" in problems, problems
