"""The mechanics shared by the loaders that repack their documents into rows every epoch (SFT, best-fit
pretraining): the epoch's rows built once, a step of ``B * D`` consecutive rows (micro-batch ``m`` of DP
rank ``r`` holds rows ``m*B*D + r*B + j``), the tail of an epoch that does not fill a step dropped, and
the position (``epoch``, ``consumed_rows``) that a resume restores."""

from __future__ import annotations

from data.packing import collate


class EpochRows:
    """Subclasses set ``S`` (row length), ``B`` (micro-batch), ``dp_rank`` / ``dp_size`` and implement
    ``_build_rows(epoch)`` (a list of rows, each a list of item ids) and ``_assemble(row)`` (one row's
    sample dict, :func:`data.packing.assemble_row`); then call :meth:`_start`."""

    S: int
    B: int
    dp_rank: int
    dp_size: int

    def _start(self, what: str, unit: str = "") -> None:
        """Epoch 0, nothing consumed; refuse data that cannot fill one step."""
        self.epoch, self.consumed_rows = 0, 0
        self._rows_epoch, self._rows = None, None
        if len(self._epoch_rows()) < self.B * self.dp_size:
            raise ValueError(f"only {len(self._rows)} packed {what} rows{unit} but one step needs "
                             f"micro_batch_size*dp_size={self.B * self.dp_size}: add data or lower them")

    def _build_rows(self, epoch: int) -> list:
        raise NotImplementedError

    def _assemble(self, row) -> dict:
        raise NotImplementedError

    def _epoch_rows(self) -> list:
        if self._rows_epoch != self.epoch:
            self._rows = self._build_rows(self.epoch)
            self._rows_epoch = self.epoch
        return self._rows

    def __iter__(self):
        return self

    def __len__(self) -> int:
        """Micro-batches per epoch (per rank)."""
        return len(self._epoch_rows()) // (self.B * self.dp_size)

    def __next__(self) -> dict:
        rows = self._epoch_rows()
        step = self.B * self.dp_size
        if self.consumed_rows + step > len(rows):
            self.epoch, self.consumed_rows = self.epoch + 1, 0
            rows = self._epoch_rows()
        base = self.consumed_rows + self.dp_rank * self.B
        out = [self._assemble(r) for r in rows[base:base + self.B]]
        self.consumed_rows += step
        return collate(out)

    def reset(self) -> None:
        """Restart at the first row of epoch 0 (e.g. before each validation pass)."""
        self.epoch, self.consumed_rows = 0, 0
