"""The lm-eval task configs of a task set report greedy-match accuracy only (no perplexity of
multi-token answers, a number without meaning for these items)."""

from pathlib import Path

import yaml

from eval.tasks.lm_eval_tasks import GROUP, write_configs


def test_task_configs_report_acc_only(tmp_path):
    names = write_configs(tmp_path, [("niah_single", 4096), ("vt", 8192)], Path("/data/tasks"))
    assert names == [f"{GROUP}_niah_single_4096", f"{GROUP}_vt_8192"]
    for name in names:
        cfg = yaml.safe_load((tmp_path / f"{name}.yaml").read_text())
        assert cfg["metric_list"] == [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]
        assert cfg["output_type"] == "loglikelihood"
    group = yaml.safe_load((tmp_path / f"{GROUP}.yaml").read_text())
    assert [m["metric"] for m in group["aggregate_metric_list"]] == ["acc"]
