"""The training loop on megatron-core: steps, non-finite policy, evaluation, checkpoints.

``Trainer(cfg, env).run()`` builds the model, optimizer and loaders (``train.build``), resumes or
initialises from the previous stage, trains ``train.max_steps`` optimizer steps (or stops after
``train.exit_after_steps`` with a checkpoint), validates, logs and saves. Forward/backward over
micro-batches and pipeline stages is megatron-core's ``get_forward_backward_func`` with the forward step
of ``train.forward_step``; the loss is a per-token mean over the whole global batch
(``calculate_per_token_loss``), so SFT masks of any density weigh tokens equally.
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from runtime.checkpoint_files import carried_record, configs_to_dict
from train import checkpointing as ckpt
from train.config import RunConfig, init_changes_line
from train.build import build_loaders, build_model
from train.context_parallel import locality_positions
from train.dry_run import dense_length_note
from train.device_step import queue_step, read_queued, supports_device_step
from train.distributed import DistEnv
from train.finite import grads_nonfinite_flag, weights_nonfinite
from train.gc_control import GarbageCollection
from train.forward_step import forward_step, to_microbatch
from train.metrics import IntervalStats, MetricsLogger, format_row, local_peak_memory_gib, max_over_ranks
from train.metrics import causal_attention_work, peak_flops, train_flops_per_token
from train.optim import adam_is_fused, build_optimizer, build_scheduler, mixed_precision, use_fused_adam
from train.preemption import StopSignal, interruption
from train.profiling import StepProfiler
from train.read_ahead import StepBatches


class NonFiniteError(RuntimeError):
    """A non-finite loss, gradient or weight stopped the run (nothing non-finite was applied or saved)."""


def log0(env: DistEnv, msg: str) -> None:
    if env.is_main:
        print(msg, flush=True)


class Trainer:
    def __init__(self, cfg: RunConfig, env: DistEnv):
        self.cfg, self.env = cfg, env
        self.run_dir = Path(cfg.run_dir)
        self.step = 0
        self.verified: Path | None = None  # the newest checkpoint this launch verified (loaded) or wrote (hashed)
        self.restored = False  # the start point is settled (no checkpoint of the run was changed before)
        self.nonfinite_streak = 0  # consecutive steps whose update was not applied (non-finite)
        self.precision = mixed_precision(cfg, env.device)
        self.micro_batches = cfg.train.global_batch_size // (cfg.train.micro_batch_size * env.dp_size)
        # the tokenizer and token ids every checkpoint records for the stages (and exports) after it
        self.carried = carried_record(cfg.sft.tokenizer if cfg.stage.kind == "sft" else cfg.data.tokenizer,
                                      cfg.init_from)

    # ------------------------------------------------------------------ build
    def build(self) -> "Trainer":
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        cfg, env = self.cfg, self.env
        self.model, self.output_processor = build_model(cfg, env, self.precision, log=partial(log0, env))
        self.model_config = mc = self.model[0].config
        self.optimizer = build_optimizer(cfg, self.model, self.precision)
        use_fused_adam(self.optimizer, cfg.optim.fused)  # torch has the kernel for CPUs too
        self.scheduler = build_scheduler(cfg, self.optimizer)
        mc.finalize_model_grads_func = finalize_model_grads
        mc.grad_scale_func = self.optimizer.scale_loss
        mc.no_sync_func = [m.no_sync for m in self.model] if len(self.model) > 1 else self.model[0].no_sync
        self.train_loader, self.valid_loader = build_loaders(cfg, env, log=partial(log0, env))
        self.train_batches = StepBatches(self.train_loader, self.micro_batches)
        self.flops_per_token = train_flops_per_token(cfg.model, cfg.attention, cfg.train.seq_length)
        self.peak = peak_flops(env.device)
        return self

    # ------------------------------------------------------------------ start point
    def restore(self) -> None:
        """``checkpoint.resume=auto``: continue this run; else ``init_from``: weights of a previous stage."""
        cfg, env = self.cfg, self.env
        latest = ckpt.select_checkpoint(ckpt.checkpoints_dir(str(self.run_dir)), verify=ckpt.verify_shared,
                                        fallback=cfg.checkpoint.on_corrupt == "fallback", log=partial(log0, env),
                                        allow_foreign=cfg.checkpoint.allow_unverified,
                                        foreign_hint=ckpt.UNVERIFIED_HINT) \
            if cfg.checkpoint.resume == "auto" else None
        if latest is not None:
            self.step, loader_state, extra = ckpt.load_checkpoint(latest, self.model, self.optimizer, self.scheduler,
                                                                  cfg.run.seed, log=partial(log0, env))
            use_fused_adam(self.optimizer, cfg.optim.fused)  # the checkpoint brought its groups' settings
            self.train_batches.load_state_dict(loader_state)
            self.nonfinite_streak = int(extra.get("nonfinite_streak", 0))
            self.verified = latest
            log0(env, f"resumed from {latest} at step {self.step}")
        elif cfg.init_from:
            src = ckpt.load_weights(cfg.init_from, self.model, log=partial(log0, env),
                                    allow_unverified=cfg.checkpoint.allow_unverified)
            for m in self.model:  # keep every DP replica identical after a partial load
                m.broadcast_params()
            if self.precision in ("bf16", "fp16"):
                self.optimizer.reload_model_params()
            log0(env, f"initialised weights from {src}")
            changed = init_changes_line(cfg)
            if changed:
                log0(env, changed)
        self.restored = True
        if adam_is_fused(self.optimizer):  # read back after any load: what the steps will run
            log0(env, "optimizer: torch's fused AdamW kernel")

    # ------------------------------------------------------------------ steps
    def _microbatches(self, loader) -> list[dict]:
        return [to_microbatch(next(loader), self.env.device, self.env.cp) for _ in range(self.micro_batches)]

    def _forward_backward(self, mbs: list[dict], forward_only: bool) -> torch.Tensor | None:
        """Run megatron's schedule; returns [loss_sum, tokens] summed over DP x CP on the last stage."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        seq = mbs[0]["tokens"].shape[1] * self.env.cp[0]  # megatron's schedules divide by CP
        mbsz = mbs[0]["tokens"].shape[0]
        iters = iter(mbs) if len(self.model) == 1 else [iter(mbs) for _ in self.model]
        out = get_forward_backward_func()(
            forward_step_func=partial(forward_step, output_processor=self.output_processor), data_iterator=iters,
            model=self.model,
            num_microbatches=len(mbs), seq_length=seq, micro_batch_size=mbsz, forward_only=forward_only)
        if not ps.is_pipeline_last_stage(ignore_virtual=True):
            return None
        total = torch.stack([o["lm loss"] for o in out]).sum(0)
        dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
        return total

    def _loss_tensor_on_all_ranks(self, total: torch.Tensor | None) -> torch.Tensor:
        """``[1]`` float64 on the device: the mean loss, broadcast from the last pipeline stage to every
        rank (NaN handling); not read by the host."""
        from megatron.core import parallel_state as ps

        t = torch.zeros(1, dtype=torch.float64, device=self.env.device)
        if total is not None:
            t.copy_((total[0] / total[1].clamp(min=1)).reshape(1))
        if ps.get_pipeline_model_parallel_world_size() > 1:
            src = ps.get_pipeline_model_parallel_last_rank()
            dist.broadcast(t, src=src, group=ps.get_pipeline_model_parallel_group())
        return t

    def _loss_on_all_ranks(self, total: torch.Tensor | None) -> float:
        return float(self._loss_tensor_on_all_ranks(total)[0])

    def _loss_and_grads_nonfinite(self, total: torch.Tensor | None) -> tuple[float, bool]:
        """The mean loss on every rank and whether any rank's gradients hold NaN/inf, read together
        (one host wait per step). fp16 skips the gradient check: megatron's loss scaler does it."""
        loss = self._loss_tensor_on_all_ranks(total)
        if self.precision == "fp16":
            return float(loss[0]), False
        flag = grads_nonfinite_flag(self.model, self.env.device)
        got_loss, got_flag = torch.cat([loss, flag.to(loss.dtype)]).tolist()
        return got_loss, got_flag > 0

    def _nosa_modules(self) -> list:
        from nosa_layers.megatron import NOSACoreAttention

        return [m for chunk in self.model for m in chunk.modules() if isinstance(m, NOSACoreAttention)]

    def _locality(self, mb: dict) -> dict:
        """Decode-time locality of the last micro-batch's selections in this rank's NOSA layers.

        gamma(t) = |S_t ∩ S_{t-1}| / |S_t| over rows that are not the first token of a document.
        """
        from nosa_layers.locality import packed_locality_summary

        sels = []
        for m in self._nosa_modules():
            if m.last_selection is not None:
                sels.append((m.last_selection, m.cfg.block_size))
                m.last_selection = None
        return packed_locality_summary(sels, locality_positions(mb))

    def train_step(self) -> dict:
        # the phases are profiler ranges: train.gpu_idle splits the GPU's idle time among them
        with torch.profiler.record_function("train.step_start"):
            for m in self.model:
                m.zero_grad_buffer()
            self.optimizer.zero_grad()
            batches = self.train_batches.take()
            work = causal_attention_work(batches)
            mbs = [to_microbatch(b, self.env.device, self.env.cp) for b in batches]
            mbs[0]["first"] = True
        every = self.cfg.train.locality_interval
        record = bool(every) and (self.step + 1) % every == 0
        for m in self._nosa_modules() if record else []:
            m.record_selection = True
        with torch.profiler.record_function("train.forward_backward"):
            total = self._forward_backward(mbs, forward_only=False)
        if self.step + 1 < self.cfg.train.max_steps:
            with torch.profiler.record_function("train.read_ahead"):
                self.train_batches.read_ahead()  # the GPU runs this step's work; the loss read below waits for it
        stats = {}
        if record:
            stats = self._locality(mbs[-1])
            for m in self._nosa_modules():
                m.record_selection = False
        lr = self.optimizer.param_groups[0]["lr"]  # the LR this step applies
        if self.cfg.train.step_reads == "at_log":
            return {"reads": self._queue_update(total), "lr": lr, "attention_work": work, **stats}
        with torch.profiler.record_function("train.checks"):
            loss, grads_bad = self._loss_and_grads_nonfinite(total)
        bad = None
        if not math.isfinite(loss):
            bad = f"loss is {loss}"
        elif grads_bad:
            bad = f"loss is {loss:.4f} but the gradients hold NaN/inf"  # fp16: megatron's loss scaler skips
        grad_norm = None
        ok = False
        with torch.profiler.record_function("train.optimizer"):
            if bad is None:
                ok, grad_norm, _ = self.optimizer.step()
                if not ok and grad_norm is not None and not math.isfinite(grad_norm):
                    bad = f"loss is {loss:.4f} but the gradient norm is {grad_norm}"
            self.scheduler.step(increment=1)
        if bad is not None:
            self._non_finite_step(bad)
        else:
            self.nonfinite_streak = 0
        return {"loss": loss, "lr": lr, "skipped": not ok, "attention_work": work,
                "grad_norm": float(grad_norm) if grad_norm is not None else None, **stats}

    def _queue_update(self, total: torch.Tensor | None) -> tuple:
        """``train.step_reads=at_log``: the update with nothing read by the host: clipped, and skipped for a
        non-finite loss or gradient, on the device (``train.device_step.queue_step``); read by :meth:`_settle`."""
        with torch.profiler.record_function("train.checks"):
            loss = self._loss_tensor_on_all_ranks(total)
            flag = grads_nonfinite_flag(self.model, self.env.device)
        with torch.profiler.record_function("train.optimizer"):
            queued = queue_step(self.optimizer, loss, flag, self.env.device)
            self.scheduler.step(increment=1)
        return queued

    def _settle(self, pending: list) -> list:
        """Read the values of the ``(step, result, dt)`` steps queued by :meth:`_queue_update` (waiting for
        the GPU only as far as the newest of them), apply the non-finite policy to each in order (it may
        raise) and return them with ``loss``, ``skipped`` and ``grad_norm`` filled in."""
        out = []
        for step, res, dt in pending:
            loss, skipped, norm = read_queued(res.pop("reads"))
            res.update(loss=loss, skipped=skipped, grad_norm=norm)
            if skipped:
                what = f"loss is {loss}" if not math.isfinite(loss) else (
                    f"loss is {loss:.4f} but the gradients or their norm ({norm}) hold NaN/inf")
                self._non_finite_step(what, step)
            else:
                self.nonfinite_streak = 0
            out.append((step, res, dt))
        return out

    def _account(self, pending: list, interval: IntervalStats) -> dict:
        """Add the ``pending`` steps to ``interval`` (reading the values of those queued without a host read
        first, the wait shared out among their step times) and empty it; returns the newest step's result."""
        t0 = time.perf_counter()
        steps = self._settle(pending) if "reads" in pending[-1][1] else list(pending)
        wait = (time.perf_counter() - t0) / len(steps)
        for _, res, dt in steps:
            interval.add(res["loss"], dt + wait, res["attention_work"])
        pending.clear()
        return steps[-1][1]

    def _non_finite_step(self, what: str, step: int | None = None) -> None:
        """A step whose update was not applied: stop (policy ``stop``) or count it (``skip``)."""
        t = self.cfg.train
        self.nonfinite_streak += 1
        step = self.step + 1 if step is None else step
        if t.nan_policy == "skip" and self.nonfinite_streak < t.nan_skip_limit:
            log0(self.env, f"step {step}: {what}; update skipped ({self.nonfinite_streak} in a row, "
                           f"the run stops at train.nan_skip_limit={t.nan_skip_limit})")
            return
        kept = self.newest_verified()
        if t.nan_policy == "skip":
            raise NonFiniteError(f"step {step}: {what}; {self.nonfinite_streak} consecutive steps skipped "
                                 f"(train.nan_skip_limit={t.nan_skip_limit}); stopping, the weights were not "
                                 f"updated by any of them ({kept}). Lower optim.lr or check the data")
        raise NonFiniteError(f"step {step}: {what}; the update was not applied, stopping ({kept}). Lower "
                             f"optim.lr, check the data, or set train.nan_policy=skip to skip such steps")

    def newest_verified(self, scan: bool | None = None) -> str:
        """``newest verified checkpoint: <dir>``: the one this launch loaded or wrote (its files hashed), else
        the newest on disk whose files match their manifest hashes (read with ``scan``: by the main rank)."""
        good = self.verified
        if good is None and (self.env.is_main if scan is None else scan):
            good = ckpt.newest_verified_checkpoint(str(self.run_dir))
        return f"newest verified checkpoint: {good}" if good else "no checkpoint of this run was written"

    def interrupted(self, e: KeyboardInterrupt | None = None) -> str:
        """The line for a run stopped by Ctrl-C, or by a save signal before its steps began (nothing saved)."""
        what = interruption(e) if e is not None else "interrupted"
        if not self.restored:
            return f"{what} while starting: nothing was trained, no checkpoint was changed"
        return f"{what} at step {self.step}; {self.newest_verified()}"

    @contextmanager
    def _params_synced(self):
        """With ``parallel.overlap_param_gather`` the distributed optimizer's updated parameters are
        all-gathered lazily, by forward pre-hooks of the next training step; evaluation and
        checkpointing first force that gather (megatron's rule) and restore the hooks after."""
        hooked = [m for m in self.model if getattr(m, "use_forward_hook", False)]
        for m in hooked:
            m.disable_forward_pre_hook(param_sync=True)
        try:
            yield
        finally:
            for m in hooked:
                m.enable_forward_pre_hook()

    def evaluate(self) -> float | None:
        if self.valid_loader is None or self.cfg.train.eval_iters == 0:
            return None
        with self._params_synced(), torch.no_grad():
            return self._evaluate()

    def _evaluate(self) -> float:
        for m in self.model:
            m.eval()
        self.valid_loader.reset()
        totals = []
        for _ in range(self.cfg.train.eval_iters):
            t = self._forward_backward(self._microbatches(self.valid_loader), forward_only=True)
            totals.append(t if t is not None else torch.zeros(2, device=self.env.device))
        for m in self.model:
            m.train()
        total = torch.stack(totals).sum(0)
        return self._loss_on_all_ranks(total if self.env.is_last_stage else None)

    def save(self) -> None:
        if not self.cfg.checkpoint.save:
            return
        with self._params_synced():
            self._save()

    def _save(self) -> None:
        if weights_nonfinite(self.model, self.env.device):
            raise NonFiniteError(f"the weights hold NaN/inf at step {self.step}: not saving a checkpoint "
                                 f"({self.newest_verified()})")
        self.verified = ckpt.save_checkpoint(
            str(self.run_dir), self.step, self.model, self.optimizer, self.scheduler, self.train_batches.state_dict(),
            {"recipe": self.cfg.recipe, "nonfinite_streak": self.nonfinite_streak},
            keep_last=self.cfg.checkpoint.keep_last, log=partial(log0, self.env),
            model_config={**configs_to_dict(self.cfg.model, self.cfg.attention), "recipe": self.cfg.recipe,
                          **self.carried},
            newest_verified=self.verified)

    # ------------------------------------------------------------------ loop
    def run(self, stop: StopSignal | None = None) -> dict:
        """Build, restore and train. ``stop``: the caller's save-signal handler, left installed (else one for
        the run); armed when the steps begin: a signal before that ends the start at once (nothing to save)."""
        cfg, env = self.cfg, self.env
        own = stop is None
        stop = stop or StopSignal(cfg.cluster.save_signals, env.device, armed=False)
        try:
            self.build()
            self.restore()
            why = supports_device_step(self.optimizer) if cfg.train.step_reads == "at_log" else None
            if why is not None:
                raise ValueError(f"train.step_reads=at_log cannot run this optimizer: {why}; "
                                 f"use train.step_reads=each_step")
            return self._loop(stop)
        finally:
            if own:
                stop.release()

    def _loop(self, stop: StopSignal) -> dict:
        cfg, env, t = self.cfg, self.env, self.cfg.train
        logger = MetricsLogger(str(self.run_dir), enabled=env.owns_loss, wandb_mode=cfg.logging.wandb,
                               wandb_project=cfg.logging.wandb_project, run_name=cfg.recipe,
                               config=dataclasses.asdict(cfg), resume_step=self.step,
                               tensorboard=cfg.logging.tensorboard)
        interval = IntervalStats()
        stop.arm()  # a save signal from here on saves at the next step boundary
        tokens_per_step = t.global_batch_size * t.seq_length
        start_step, saved_at = self.step, self.step
        last: dict = {}
        pending: list = []  # (step, result, seconds) of the steps whose values the host has not read yet
        if self.step >= t.max_steps:
            log0(env, f"run.dir {self.run_dir} is already at step {self.step} = train.max_steps: nothing to train "
                      f"(raise train.max_steps to continue)")
        log0(env, f"training {cfg.recipe}: steps {self.step} -> {t.max_steps}, {self.micro_batches} "
                  f"micro-batches/step, {tokens_per_step} tokens/step, run dir {self.run_dir}")
        dense = dense_length_note(cfg)
        if dense:
            log0(env, dense)
        profiler = StepProfiler(cfg.profile.start_step, cfg.profile.num_steps, str(self.run_dir), env.owns_loss,
                                with_stack=cfg.profile.with_stack)
        collector = GarbageCollection(t.gc_interval)
        collector.__enter__()
        try:
            while self.step < t.max_steps:
                if t.exit_after_steps is not None and self.step - start_step >= t.exit_after_steps:
                    log0(env, f"exit_after_steps={t.exit_after_steps} reached at step {self.step}")
                    break
                profiler.before(self.step + 1)
                t0 = time.perf_counter()
                out = self.train_step()
                collector.after_step(self.step + 1)  # inside the timed step: users pay for it
                dt = time.perf_counter() - t0
                self.step += 1
                profiler.after(self.step, partial(log0, env))
                pending.append((self.step, out, dt))
                eval_now = bool(t.eval_interval and self.step % t.eval_interval == 0)
                log_now = self.step % t.log_interval == 0 or self.step == t.max_steps
                save_now = bool(cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0)
                launch_ends = t.exit_after_steps is not None and self.step - start_step >= t.exit_after_steps
                got = None
                if "reads" in out and not (eval_now or log_now or save_now or launch_ends):  # train.step_reads=at_log
                    # a save signal is agreed on every step with one rank (no collective), else at the reads:
                    # the agreement's collective would make every step wait for the GPU
                    got = stop.agreed() if env.world_size == 1 else None
                    if got is None:
                        continue
                out = self._account(pending, interval)
                row = {"step": self.step, "loss": out["loss"], "lr": out["lr"],
                       "grad_norm": out["grad_norm"], "skipped": out["skipped"]}
                row.update({k: v for k, v in out.items() if k.startswith("nosa_")})
                if eval_now:
                    row["val_loss"] = self.evaluate()
                if log_now:
                    # interval means; peak memory over all ranks (a collective: every rank logs here)
                    row.update(interval.flush(tokens_per_step, t.max_steps - self.step))
                    row["peak_mem_gib"] = max_over_ranks(local_peak_memory_gib(env.device), env.device)
                    if self.peak:
                        row["mfu"] = tokens_per_step * self.flops_per_token / row["step_time_s"] / (
                            self.peak * env.world_size)
                    logger.log(row)
                    if env.owns_loss:
                        print(format_row(row, t.max_steps), flush=True)
                last = row
                got = stop.agreed() if got is None else got
                if save_now or got is not None:
                    self.save()
                    saved_at = self.step
                if got is not None:
                    log0(env, f"{got} received: stopping at step {self.step} ({self.newest_verified()}); the next "
                              f"launch with the same run.dir resumes from it")
                    break
            if self.step == t.max_steps and self.valid_loader is not None and t.eval_iters and \
                    not (t.eval_interval and self.step % t.eval_interval == 0):
                last = {**last, "step": self.step, "val_loss": self.evaluate()}
                logger.log({"step": self.step, "val_loss": last["val_loss"]})
            if self.step != saved_at:
                self.save()
        finally:
            collector.__exit__(None, None, None)
            if env.owns_loss and cfg.logging.plot:
                png = logger.plot()
                if png:
                    print(f"loss curve: {png}", flush=True)
            logger.close()
        return last
