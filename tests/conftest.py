"""Session-wide test settings: offline, deterministic, small thread pools."""

import os
import sys

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.cpu_time import cpu_seconds, summary_lines  # noqa: E402

# Without CUDA the Triton kernel tests (tests/ops) run under the Triton interpreter, which must be
# chosen before any kernel module is imported; nothing else runs Triton on a CPU machine.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from runtime.megatron_cpu import lean_megatron_import  # noqa: E402

    lean_megatron_import()  # megatron-core's import in this process without its GPU-only compile machinery

# Under pytest-xdist each worker shares the machine's cores with the others (and with the training
# runs they launch, which take one thread each): one intra-op thread per worker, not one per core.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") != "1":
    torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """Starts the phase's CPU clock; the same hook starts the call's and the teardown's."""
    item._cpu_start = cpu_seconds()
    yield


pytest_runtest_call = pytest_runtest_teardown = pytest_runtest_setup


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report carries its CPU seconds (``user_properties`` travel from xdist workers)."""
    report = (yield).get_result()
    if hasattr(item, "_cpu_start"):
        report.user_properties.append(("cpu_s", cpu_seconds() - item._cpu_start))


_CPU_ROWS: list = []


def pytest_runtest_logreport(report):
    cpu = dict(report.user_properties).get("cpu_s")
    if cpu is not None:
        _CPU_ROWS.append((cpu, report.when, report.nodeid))


def pytest_terminal_summary(terminalreporter):
    report = os.environ.get("NOSA_TEST_CPU_REPORT")
    if report and _CPU_ROWS:  # every phase's CPU seconds, for planning the suite's balance
        import json

        Path(report).write_text(json.dumps(sorted(_CPU_ROWS, reverse=True), indent=0))
    if _CPU_ROWS:
        terminalreporter.write_sep("=", "CPU seconds per test phase (with child processes)")
        for line in summary_lines(_CPU_ROWS, 15):
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _deterministic_torch():
    """Fresh default dtype and seed for each test; the test restores nothing by hand."""
    dtype = torch.get_default_dtype()
    torch.manual_seed(1234)
    yield
    torch.set_default_dtype(dtype)


TESTS = Path(__file__).resolve().parent


# The longest work groups first (by their CPU seconds with child processes, NOSA_TEST_CPU_REPORT): pytest-xdist
# hands the groups out in collection order, so the long ones start early and the short ones fill the end of the
# run (its default order, by number of tests, started the longest file of tests/train last). Groups not listed
# follow, in their own order.
SLOW_GROUPS = ["convert", "ops", "eval", "train/test_preemption.py", "megatron", "train/test_context_parallel.py",
               "train/test_train_runs.py", "train/test_memory_model.py", "train/test_ab_throughput_run.py", "data",
               "train/test_reliability.py", "train/test_loss_impl.py", "train/test_hydra_cli.py",
               "train/test_sizing.py", "train/test_step_reads.py", "train/test_config_recipes.py", "bench", "nosa",
               "test_startup_imports.py", "train/test_sft_run.py"]


def _group(item) -> str:
    parts = Path(str(item.fspath)).resolve().relative_to(TESTS).parts
    return "/".join(parts[:2]) if parts[0] == "train" else parts[0]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the group marks
def pytest_collection_modifyitems(config, items):
    """Work groups for pytest-xdist's ``--dist loadgroup`` (``scripts/test.sh`` runs two workers):
    one folder per worker, so each folder's session fixtures (tiny checkpoints, reference runs) are
    built once; ``tests/train`` (the longest folder) is split by file to balance the workers. The
    groups are ordered longest first (``SLOW_GROUPS``; a stable sort: each group's, hence each
    module's, tests stay together and in their order)."""
    rank = {g: i for i, g in enumerate(SLOW_GROUPS)}
    groups = {item: _group(item) for item in items}
    items.sort(key=lambda item: rank.get(groups[item], len(SLOW_GROUPS)))
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item]))


def pytest_configure(config):
    """``--dist loadgroup`` needs a pytest that pytest-xdist can group under: xdist <= 3.8 marks a
    group as an ``@group`` suffix written to ``item._nodeid``, which pytest 9 no longer reads, so the
    groups would silently spread over all workers (each folder's session fixtures built on each)."""
    if config.getoption("dist", "no") != "loadgroup":
        return
    config.option.loadscopereorder = False  # keep the longest-first order of pytest_collection_modifyitems
    if int(pytest.__version__.split(".")[0]) < 9:
        return
    import xdist

    if tuple(int(x) for x in xdist.__version__.split(".")[:2]) <= (3, 8):
        raise pytest.UsageError(f"--dist loadgroup does not group tests with pytest {pytest.__version__} and "
                                f"pytest-xdist {xdist.__version__}: install pytest<9 (pyproject.toml's dev extra)")


_PROCESS_GROUP_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_process_group_environment_left():
    """A test that starts a process group in this process (a trainer or a tool run in-process) must leave the
    environment as it found it: RANK / WORLD_SIZE / MASTER_* left behind change what the worker's later tests
    and their subprocesses do (a dry run then checks the layout against WORLD_SIZE=1). Restored, and the
    test that left them fails, naming them."""
    before = {k: os.environ.get(k) for k in _PROCESS_GROUP_ENV}
    yield
    left = {k: os.environ.get(k) for k in _PROCESS_GROUP_ENV if os.environ.get(k) != before[k]}
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if left:
        pytest.fail(f"the test left process-group variables in os.environ: {left} (run train/main.py in-process "
                    f"through tests.train.conftest.train_here, which restores them)", pytrace=False)


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """A default process group that a test's in-process call left (``checkpoints_convert.megatron_io`` keeps its
    world-size-1 group, and megatron-core's model-parallel state on it, for the rest of a command) is destroyed
    after the test: a later test of the same worker that forks ranks (``tests/data/test_sft_scale.py``) would
    inherit it and fail to start its own. Groups that existed before the test (a module's fixture) stay."""
    import torch.distributed as dist

    before = dist.is_available() and dist.is_initialized()
    yield
    if before or not (dist.is_available() and dist.is_initialized()):
        return
    if "megatron.core" in sys.modules:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    dist.destroy_process_group()
