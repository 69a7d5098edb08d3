"""lm-eval (lm-evaluation-harness) task configs for a generated task set: local files only.

For every (task, length) a YAML ``nosa_ruler_<task>_<length>.yaml`` reads the items file
``<task>_<length>.items.jsonl`` (one loglikelihood request per answer item: ``context``,
``continuation``) with the ``json`` builder of ``datasets`` (no hub access) and reports ``acc``
(greedy match; lm-eval's ``perplexity`` of a multi-token answer is exp of its summed negative
loglikelihood, a number without meaning here, so it is not reported); the group ``nosa_ruler``
holds them all. Run them with the
harness itself, e.g.::

    lm_eval --model hf --model_args pretrained=<HF export>,trust_remote_code=True \\
        --include_path <task dir> --tasks nosa_ruler --batch_size 1
"""

from __future__ import annotations

from pathlib import Path

GROUP = "nosa_ruler"


def task_name(task: str, length: int) -> str:
    return f"{GROUP}_{task}_{length}"


def task_yaml(name: str, items_file: Path, cache_dir: Path) -> str:
    return "\n".join([
        f"task: {name}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {items_file.resolve()}",
        f"  cache_dir: {cache_dir.resolve()}",
        "output_type: loglikelihood",
        "test_split: test",
        "doc_to_text: context",
        "doc_to_target: continuation",
        'target_delimiter: ""',
        "metric_list:",
        "  - metric: acc",
        "    aggregation: mean",
        "    higher_is_better: true",
        "metadata:",
        "  version: 1.0",
        "",
    ])


def group_yaml(names: list[str]) -> str:
    lines = [f"group: {GROUP}", "task:"] + [f"  - {n}" for n in names]
    lines += ["aggregate_metric_list:", "  - metric: acc", "    aggregation: mean", "    weight_by_size: false",
              "metadata:", "  version: 1.0", ""]
    return "\n".join(lines)


def write_configs(root: Path, pairs: list[tuple[str, int]], final_root: Path) -> list[str]:
    """YAMLs in ``root`` for ``(task, length)`` pairs whose items files will live in ``final_root``
    (absolute paths: lm-eval resolves ``data_files`` against the working directory); returns the task names."""
    names = []
    for task, length in pairs:
        name = task_name(task, length)
        (root / f"{name}.yaml").write_text(
            task_yaml(name, final_root / f"{task}_{length}.items.jsonl", final_root / ".hf_cache"))
        names.append(name)
    (root / f"{GROUP}.yaml").write_text(group_yaml(names))
    return names
