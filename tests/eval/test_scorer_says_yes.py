"""The RULER scorer can say yes: a model that retrieves scores near 1 through the direct and the
lm-eval path, one that is nearly right scores 0 strictly but high on the graded signals."""

import pytest

from tests.eval.oracle import RetrievalOracle, oracle_lm, solve, split_prompt

LENGTHS = [384, 512]


@pytest.fixture(scope="module")
def task_set(small_demo, tmp_path_factory):
    from data.tokenizer import Tokenizer
    from eval.tasks import TaskSetConfig, build_task_set, encoder, load_task_set

    tok = Tokenizer(small_demo["tokenizer"])
    out = build_task_set(small_demo["corpus"], tok, tmp_path_factory.mktemp("oracle") / "tasks",
                         TaskSetConfig(lengths=LENGTHS, samples=3, seed=7), log=lambda *_: None)
    return tok, encoder(tok), load_task_set(out)


def _direct(task_set, corrupt):
    from eval.ruler import score_direct, summarize

    tok, enc, ts = task_set
    oracle = RetrievalOracle(enc, tok.decode, corrupt=corrupt)
    return summarize(score_direct(oracle, tok, ts, LENGTHS, ts.tasks, log=lambda *_: None))


def test_the_oracle_reads_the_prompt_not_the_answers(task_set):
    _, _, ts = task_set
    for task in ts.tasks:
        for row in ts.samples(task, 512):
            assert split_prompt(row["prompt"] + " x, y") == row["prompt"]
            assert solve(row["prompt"]) == row["answers"], task


def test_a_retriever_scores_near_one_directly(task_set):
    s = _direct(task_set, corrupt=False)
    assert s["average"] >= 90 and min(c["score"] for c in s["cells"]) >= 90
    assert s["graded"]["token_match"] >= 0.9 and s["graded"]["loglik_per_token"] > -0.1
    assert s["needles"]["score"] >= 90 and s["average_stderr"] is not None


def test_a_nearly_right_model_shows_on_the_graded_signals_only(task_set):
    s = _direct(task_set, corrupt=True)
    assert s["average"] <= 10  # the strict score does not move ...
    assert 0.3 <= s["graded"]["token_match"] < 0.95  # ... the share of answer tokens does
    right = _direct(task_set, corrupt=False)
    assert s["graded"]["loglik_per_token"] < right["graded"]["loglik_per_token"]


def test_a_retriever_scores_near_one_through_lm_eval(task_set):
    from eval.ruler import score_lm_eval, summarize

    tok, enc, ts = task_set
    items = score_lm_eval(None, ts, [512], ts.tasks, lm=oracle_lm(RetrievalOracle(enc, tok.decode)),
                          log=lambda *_: None)
    s = summarize(items)
    assert len(items) == 3 * (1 + 1 + 4 + 4 + 5 + 5 + 3)
    assert s["average"] >= 90 and s["graded"]["loglik_per_token"] > -0.1
    assert s["graded"]["token_match"] is None  # lm-eval reports whole items only
    wrong = summarize(score_lm_eval(None, ts, [512], ts.tasks, lm=oracle_lm(RetrievalOracle(enc, tok.decode, True)),
                                    log=lambda *_: None))
    assert wrong["average"] <= 10
