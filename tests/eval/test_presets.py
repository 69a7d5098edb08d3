"""``eval.ablate --set FIELD=VALUE`` / ``--train-override STAGE:KEY=VALUE``: typed changes of a preset,
one-line refusals."""

import pytest

from eval.errors import EvalError
from eval.presets import get_preset


def test_settings_and_train_overrides_change_a_copy():
    base = get_preset("proof_h200")
    p = base.with_settings(["retrieval_share=0.9", "pretrain.steps=4000", "pretrain_doc_lengths=256,512",
                            "task_samples=20"], ["pretrain:train.global_batch_size=8", "cpt:optim.lr=5e-4"])
    assert (p.retrieval_share, p.pretrain.steps, p.pretrain_doc_lengths, p.task_samples) == (0.9, 4000, [256, 512], 20)
    assert p.pretrain.overrides[-1] == "train.global_batch_size=8" and p.cpt.overrides[-1] == "optim.lr=5e-4"
    assert base.retrieval_share == 0.8 and base.pretrain.steps == 900 and "optim.lr=5e-4" not in base.cpt.overrides


@pytest.mark.parametrize("settings, overrides, message", [
    (["nope=1"], [], "not a preset field"),
    (["retrieval_share=x"], [], "not a float"),
    (["pretrain.steps"], [], "give FIELD=VALUE"),
    ([], ["train:optim.lr=1"], "give pretrain:KEY=VALUE"),
    ([], ["pretrain:train.max_steps=3"], "--set pretrain.steps=N"),
])
def test_bad_settings_are_one_line(settings, overrides, message):
    with pytest.raises(EvalError, match=message.replace(".", r"\.")):
        get_preset("proof_h200").with_settings(settings, overrides)
