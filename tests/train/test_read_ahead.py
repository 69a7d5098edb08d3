"""The next step's batches read ahead while the GPU runs a step (``train/read_ahead.py``): the
batch order is the loader's, a checkpoint never counts the batches read ahead, and a read that
fails ahead of time raises at the step that needs the data. (End to end, a run stopped and resumed
with batches read ahead equals an uninterrupted one: ``test_train_runs``.)"""

import pytest

from train.read_ahead import StepBatches


class _Loader:
    """Batches 1, 2, 3, ...; reading batch ``fail_at`` raises."""

    def __init__(self, fail_at=None):
        self.n, self.fail_at = 0, fail_at

    def __next__(self):
        if self.n + 1 == self.fail_at:
            raise ValueError(f"bad sample in batch {self.fail_at}")
        self.n += 1
        return self.n

    def state_dict(self):
        return {"consumed": self.n}

    def load_state_dict(self, state):
        self.n = state["consumed"]


def test_batches_read_ahead_come_next_and_checkpoints_do_not_count_them():
    batches = StepBatches(_Loader(), per_step=2)
    assert batches.take() == [1, 2] and batches.state_dict() == {"consumed": 2}
    batches.read_ahead()
    assert batches.loader.n == 4 and batches.state_dict() == {"consumed": 2}  # a checkpoint here resumes at 3
    assert batches.take() == [3, 4] and batches.state_dict() == {"consumed": 4}
    assert batches.take() == [5, 6]  # nothing read ahead: read now
    batches.read_ahead()
    with pytest.raises(RuntimeError, match="already read ahead"):
        batches.read_ahead()


def test_a_failed_read_ahead_raises_at_the_step_that_needs_the_data():
    batches = StepBatches(_Loader(fail_at=4), per_step=2)
    assert batches.take() == [1, 2]
    batches.read_ahead()  # batch 3 is read, batch 4 fails: kept for the next step
    assert batches.state_dict() == {"consumed": 2}
    with pytest.raises(ValueError, match="bad sample in batch 4"):
        batches.take()


def test_loading_a_state_drops_the_batches_read_ahead():
    batches = StepBatches(_Loader(), per_step=2)
    batches.take()
    batches.read_ahead()  # batches 3, 4 from the old position
    batches.load_state_dict({"consumed": 10})
    assert batches.take() == [11, 12] and batches.state_dict() == {"consumed": 12}
