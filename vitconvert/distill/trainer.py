"""The distill loop, as plain as timm's train.py: teacher forward, student forward, loss, step; repeat.

The Trainer sets up, in its ``__init__`` and in this order, what the loop shares: the task (student, teacher,
taps, wrapper, EMA, eval model), the data, the stage of every optimizer step, the run folder (or the checkpoint
being resumed), the optimizer and the running sums; then ``fit`` runs. It saves at set moments: best/ when
validation improves, checkpoint-last/ at each epoch end and on a stop signal, the run folder's model at the end.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from .. import data, loading, top_k
from .. import distributed as D
from ..errors import VitconvertError, load_reason, param, setting
from ..evaluate import eval_sums, metrics_from_sums
from ..provenance import report_of
from ..recipe_report import recipe_changes, recipe_summary
from ..writer import output_lock
from . import models
from . import param_groups as groups
from .checkpoint import (
    CHECKPOINT,
    Checkpoint,
    Position,
    check_optimizer_fits,
    read_checkpoint,
    restore_rng,
    rng_state,
    seed_everything,
    write_checkpoint,
)
from .final_compare import compare_at_end
from .job import DistillJob, RunResult, job_record, resumed_teacher
from .monitor import Bar, Monitor, plot_curves
from .runfolder import (
    RunGuard,
    card_metrics,
    check_run_folder,
    job_inputs,
    prepare_run_folder,
    record_recipe,
    write_model_folder,
)
from .signals import StopRequest
from .stages import plan_stages
from .sums import TERMS, RunningSums
from .task import DistillationTask


class Trainer:
    """The loop around a :class:`DistillationTask`, read top to bottom as torchtune's recipes are: set up the
    models, the data, the run folder and the optimizer, then ``fit``."""

    def __init__(self, job: DistillJob, env: D.DistEnv):
        r = job.recipe
        self.job, self.recipe, self.env, self.run_dir = job, r, env, Path(job.out)
        student, teacher, self.teacher_spec, self.inp = self._setup_models()
        self.report = report_of(student)
        self.num_classes = int(student.num_classes)
        self.channels_last = env.device.type == "cuda"
        self.task = self._setup_task(student, teacher)
        self.feed = data.run_data(r, self.inp, self.num_classes, env.rank, env.world, env.device.type == "cuda")
        models.name_classes(self.task.export, self.feed.class_names)
        self.stages = plan_stages(r, self.task.model, models.attention_param_ids(self.task.attention),
                                  groups.frozen_ids(self.task.model, r), self.feed.updates_per_epoch)
        self.labels_checked = self.feed.labels_checked
        self.ckpt = self._setup_run_folder()
        self.pos = self.ckpt.position if self.ckpt is not None else Position()
        if job.fsdp:  # shards in place, before the optimizer sees the parameters
            self.task.shard(env)
        self.optimizer, self.scheduler = groups.create_optimization(self.task.model, r, self.feed.updates_per_epoch)
        self.scaler = self._setup_scaler()
        if r.optimization.ema:
            self.task.keep_ema(r.optimization.ema_decay, self.ckpt.ema() if self.ckpt is not None else None)
        keep = (self.pos.epoch, self.pos.step) if self.ckpt is not None else None
        self.monitor = Monitor(self.run_dir, env.is_main, keep_until=keep)
        self.bar = Bar(job.show and env.is_main)
        saved = self.pos if env.is_main else Position()  # rank 0 carries a resumed run's sums; the rest add to them
        self.epoch_sums = RunningSums(env.device, saved.epoch_sums)
        self.window = RunningSums(env.device, saved.window_sums)  # since the last metrics.jsonl step record
        self.window_start = time.perf_counter()
        if job.compile:
            self.task.model.compile()

    # -- setup: each builder returns what it builds ---------------------------------------------------------
    def _setup_models(self) -> tuple[nn.Module, nn.Module, str, data.InputConfig]:
        """Student, teacher, the teacher's name and the run's input, checked against each other and the recipe."""
        r, job = self.recipe, self.job
        student = loading.load_student(job.student)
        spec = loading.teacher_spec(student, job.teacher or resumed_teacher(job))
        teacher = loading.load_teacher(spec, student, r.seed, recorded=job.teacher is None, pretrained=job.pretrained)
        models.check_kd(student, teacher, r.distillation.kd_weight)
        inp = data.input_config(student, r)
        models.check_sizes(student, teacher, inp.size)
        if job.fsdp:
            models.check_fsdp(r)
        models.set_drop_path(student, r.optimization.resolved_drop_path(models.embed_width(student)))
        models.set_recompute(student, job.recompute)
        return student, teacher, spec, inp

    def _setup_task(self, student: nn.Module, teacher: nn.Module) -> DistillationTask:
        r, device, a = self.recipe, self.env.device, self.recipe.augmentation
        task = DistillationTask(student, teacher, r, device, data.teacher_normalizer(self.inp, teacher, device),
                                mixup_active=a.mixup > 0 or a.cutmix > 0, teacher_cache=self.job.teacher_cache,
                                memory_format=torch.channels_last if self.channels_last else torch.preserve_format)
        models.export_config(task.export, self.inp)
        return task

    def _setup_run_folder(self) -> Optional[Checkpoint]:
        """A new run folder, or the checkpoint of the one being resumed (its weights into the student)."""
        job = self.job
        ckpt = prepare_run_folder(self.run_dir, self.recipe, job.recipe_text, job.resume, job.force, self.env,
                                  job_inputs(job.student, job.teacher, self.recipe))
        if ckpt is not None:
            ckpt.check_same_job(job_record(job, self.report, self.teacher_spec), job.force)
            try:
                self.task.model.load_state_dict(ckpt.model())
            except RuntimeError as e:  # a checkpoint of another architecture (written before the job record)
                raise VitconvertError(f"{self.run_dir / CHECKPOINT} does not fit the student {job.student}: "
                                      f"{load_reason(e)}; resume with the run's own student") from None
        return ckpt

    def _setup_scaler(self) -> Optional[torch.amp.GradScaler]:
        o = self.recipe.optimization
        fp16 = self.env.device.type == "cuda" and o.amp and o.amp_dtype == "float16"
        return torch.amp.GradScaler("cuda") if fp16 else None

    def restore(self, ckpt: Checkpoint) -> None:
        """The optimizer, schedule, scaler and RNG states of the resumed checkpoint (its weights are loaded)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        env = self.env
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        saved = ckpt.optimizer()
        check_optimizer_fits(saved, self.optimizer, self.task.student)
        set_optimizer_state_dict(self.task.student, self.optimizer, saved,
                                 options=StateDictOptions(full_state_dict=True))
        if recipe_changes(ckpt.recipe, self.recipe):  # resumed with force: the new recipe's settings and schedule
            for group, values in zip(self.optimizer.param_groups, hyper, strict=True):
                group.update(values)
            self.scheduler.step(self.pos.epoch)
            self.scheduler.step_update(self.pos.step)
        else:
            self.scheduler.load_state_dict(ckpt.meta["scheduler"])
        if self.scaler is not None and ckpt.meta.get("scaler"):
            self.scaler.load_state_dict(ckpt.meta["scaler"])
        rng = ckpt.rng(env.rank) if ckpt.meta.get("world") == env.world else None
        if rng is None:
            self.bar.print(f"note: the checkpoint was written by {ckpt.meta.get('world')} process(es), this run "
                           f"has {env.world}: training continues, but not bitwise as the original would have")
            seed_everything(self.recipe.seed + env.rank + 1000 * self.pos.epoch)
        else:
            restore_rng(rng)

    # -- the loop -------------------------------------------------------------------------------------
    def fit(self, on_step: Optional[Callable[[Trainer], None]] = None) -> RunResult:
        """Train every epoch left (all of them, or the rest after a resume), then write the final folder."""
        r, start = self.recipe, time.perf_counter()
        epochs = r.schedule.epochs
        self.task.enter(self.stages.at(self.pos.step), self.env, sharded=self.job.fsdp)
        self.bar.print(f"{'resuming' if self.ckpt is not None else 'distilling'} {self.job.student} from the teacher "
                       f"{self.teacher_spec} into {self.run_dir}")  # the student may not have been named
        for line in recipe_summary(r):
            self.bar.print(line)
        if self.ckpt is not None:
            self.restore(self.ckpt)
            record_recipe(self.run_dir, r, self.ckpt, self.job.recipe_text, self.env)
        else:
            seed_everything(r.seed + self.env.rank)
        with StopRequest() as stop:  # the whole run: a stop in the last epoch's validation or the end is one too
            for epoch in range(self.pos.epoch, epochs):
                self.train_epoch(epoch, stop, on_step)
                self.end_epoch(epoch)
            if stop.asked(self.env):  # its checkpoint holds every epoch: a resume writes the final model
                raise stop.stopped(f"after the last epoch ({epochs}), before writing the final model", self.run_dir)
            return self.finish(time.perf_counter() - start, stop)

    def train_epoch(self, epoch: int, stop: StopRequest, on_step: Optional[Callable[[Trainer], None]]) -> None:
        """One epoch of micro-steps; stops cleanly between steps when asked (Ctrl-C, SIGTERM)."""
        r, accum = self.recipe, self.recipe.optimization.accum_steps
        data.set_epoch(self.feed.train, epoch, self.pos.batch)
        self.task.student.train()
        self.window_start = time.perf_counter()
        self.task.enter(self.stages.at(self.pos.step), self.env, sharded=self.job.fsdp)
        self.bar.start(f"epoch {epoch + 1}/{r.schedule.epochs} {self.task.stage}", self.feed.updates_per_epoch,
                       self.pos.batch // accum)
        try:
            for images, targets in self.feed.train:
                if self.pos.batch >= self.feed.micro_per_epoch:
                    break
                if self.pos.batch % accum == 0:  # a stage counted in steps may end inside an epoch
                    self.task.enter(self.stages.at(self.pos.step), self.env, sharded=self.job.fsdp)
                sync = (self.pos.batch + 1) % accum == 0
                sums = self.micro_step(images, targets, sync)
                self.epoch_sums.add(sums)
                self.window.add(sums)
                self.pos.batch += 1
                if not sync:
                    continue
                self.optimizer_step()
                terms = self.log_step(epoch) if self.pos.step % r.reporting.log_interval == 0 else None
                self.bar.advance(terms)
                if on_step is not None:
                    on_step(self)
                if stop.asked(self.env):
                    self.save_checkpoint()
                    raise stop.stopped(f"at epoch {epoch + 1}, step {self.pos.step}", self.run_dir)
        finally:
            self.bar.stop()
        if self.window.images > 0:
            self.log_step(epoch)

    def micro_step(self, images: torch.Tensor, targets: torch.Tensor, sync: bool) -> RunningSums:
        """Forward both models and backward one micro-batch; returns its loss sums."""
        env = self.env
        images = images.to(env.device, non_blocking=True)
        targets = targets.to(env.device, non_blocking=True)
        if not self.labels_checked:
            if int(targets.max()) >= self.num_classes:
                raise VitconvertError(f"the data has labels up to {int(targets.max())} but the student's head has "
                                      f"{self.num_classes} classes: convert with {param('num_classes')}")
            self.labels_checked = True
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        if self.feed.mixup is not None:
            images, targets = self.feed.mixup(images, targets)
        with self.task.gradient_sync(sync and env.distributed):
            out = self.task(images, targets, slot=self.pos.epoch * self.feed.micro_per_epoch + self.pos.batch)
            scaled = out["loss"] / self.recipe.optimization.accum_steps
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return RunningSums.of_batch(out, images.shape[0], env.device)

    def optimizer_step(self) -> None:
        """Clip (when the recipe says), step the optimizer and its schedule, update the EMA."""
        from timm.utils import dispatch_clip_grad

        o = self.recipe.optimization
        if o.clip_grad:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            params = [p for p in self.task.model.parameters() if p.grad is not None]
            dispatch_clip_grad(params, o.clip_grad, mode=o.clip_mode)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.pos.step += 1
        self.scheduler.step_update(num_updates=self.pos.step)
        self.task.update_ema(self.pos.step)

    # -- reporting ------------------------------------------------------------------------------------
    def check_finite(self, epoch: int, *sums: RunningSums) -> None:
        """Stop a run whose loss went NaN or infinite, saying which checkpoint is still good."""
        if all(s.finite() for s in sums):
            return
        saved = read_checkpoint(self.run_dir).position.epoch if (self.run_dir / CHECKPOINT).is_dir() else None
        where = (f"the last good checkpoint ({self.run_dir / CHECKPOINT}, after epoch {saved}) is kept: resume from "
                 f"it with a lower {param('lr')} or with {setting('clip_grad', 1.0)}" if saved is not None
                 else "no checkpoint was written")
        raise VitconvertError(f"the loss became NaN or infinite at epoch {epoch + 1}, step {self.pos.step}; "
                              f"training stopped and {where}")

    def log_step(self, epoch: int) -> str:
        """The window's mean loss terms and learning rates, logged and returned for the bar."""
        totals = self.window.all_reduce(self.env)
        self.check_finite(epoch, totals)
        record: dict[str, Any] = {"kind": "step", "epoch": epoch + 1, "step": self.pos.step,
                                  **groups.logged_lrs(self.optimizer)}
        weights = self.task.weights
        active = {"loss": True, "task": bool(weights.task), "attn": bool(weights.attn), "kd": bool(weights.kd)}
        record.update({k: v for k, v in totals.mean().items() if active[k]})
        record["img_s"] = totals.images / max(time.perf_counter() - self.window_start, 1e-9)
        self.monitor.log(record)
        self.window.reset()
        self.window_start = time.perf_counter()
        return " ".join(f"{k} {record[k]:.4f}" for k in TERMS if k in record) + f"  {record['img_s']:.0f} img/s"

    def validate(self) -> dict[str, Any]:
        """Top-1, top-5 and loss of the evaluated model (EMA when on) on the validation split."""
        o, env = self.recipe.optimization, self.env
        self.task.student.eval()
        sums = D.all_sum(env, eval_sums(self.task.evaluated(), self.feed.val, env.device, o.amp, self.channels_last,
                                        o.amp_dtype))
        self.task.student.train()
        sums[-1] /= env.world
        return metrics_from_sums(sums, self.num_classes)

    def end_epoch(self, epoch: int) -> None:
        """Validate, step the schedule, log the epoch, keep the best and write the checkpoint."""
        started = time.perf_counter()
        train = self.epoch_sums.all_reduce(self.env)
        self.check_finite(epoch, train)
        val = self.validate()
        self.scheduler.step(epoch + 1)
        record: dict[str, Any] = {"kind": "epoch", "epoch": epoch + 1, "step": self.pos.step, "stage": self.task.stage,
                                  **groups.logged_lrs(self.optimizer)}
        record.update({f"train_{k}": v for k, v in train.mean().items() if k == "loss" or train.total(k)})
        record.update({"val_top1": val["top1"], "val_top5": val["top5"], "val_loss": val["loss"], "val_n": val["n"],
                       "val_seconds": time.perf_counter() - started})
        self.monitor.log(record)
        improved = val["top1"] > self.pos.best_top1
        if improved:
            self.pos.best_top1, self.pos.best_epoch = val["top1"], epoch + 1
        self.pos.epoch, self.pos.batch = epoch + 1, 0
        self.epoch_sums.reset()
        if improved:
            self.write_model(self.run_dir / "best", card_metrics(self.recipe, record, self.pos.best_top1, epoch + 1))
        self.save_checkpoint()
        self.bar.print(f"epoch {epoch + 1}/{self.recipe.schedule.epochs} [{self.task.stage}] train loss "
                       f"{record['train_loss']:.4f}  val top1 {100 * val['top1']:.2f}%  top5 "
                       f"{top_k.top_k_text(val['top5'], val['classes'])}  loss {val['loss']:.4f}")

    # -- writing --------------------------------------------------------------------------------------
    def write_model(self, folder: Path, metrics: dict[str, Any], final: bool = False,
                    stop: Optional[StopRequest] = None) -> None:
        """A model folder of the evaluated weights (EMA when on) with the recipe and results in its card; the
        final one also with the per-layer comparison with the teacher (compare.json/.png, the card's table), unless
        ``stop`` was asked for meanwhile (the run then stays resumable: its final model is what a resume writes)."""
        state = self.task.evaluated_state()
        if not self.env.is_main:
            return
        export = self.task.export
        meta = {**self.report, "recipe": self.recipe.to_dict(), "metrics": metrics, "teacher": self.teacher_spec}
        if final and self.recipe.reporting.compare_batches:
            export.load_state_dict(state)
            meta["compare"] = compare_at_end(export, teacher=self.task.softmax_teacher, teacher_spec=self.teacher_spec,
                                             feed=self.feed, inp=self.inp, recipe=self.recipe, device=self.env.device,
                                             folder=self.run_dir, note=self.bar.print)
        if stop is not None and stop.requested is not None:
            raise stop.stopped("after the last epoch, before writing the final model", self.run_dir)
        write_model_folder(export, state, folder, meta, in_place=folder == self.run_dir)

    def save_checkpoint(self) -> None:
        """Write checkpoint-last/ atomically (weights, optimizer, RNG, position): the resume point."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        D.reshard(self.task.student)
        optim = get_optimizer_state_dict(self.task.student, self.optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        model = self.task.trained_state()
        epoch_sums, window = self.epoch_sums.all_reduce(self.env), self.window.all_reduce(self.env)
        self.check_finite(self.pos.epoch, epoch_sums, window)
        rng = D.gather(self.env, rng_state())
        if self.env.is_main:
            position = replace(self.pos, epoch_sums=epoch_sums.to_list(), window_sums=window.to_list())
            write_checkpoint(self.run_dir, model=model, optimizer=optim, ema=self.task.ema_state(),
                             scheduler=self.scheduler.state_dict(),
                             scaler=self.scaler.state_dict() if self.scaler is not None else {},
                             position=position, recipe=self.recipe.to_dict(), rng=rng,
                             job=job_record(self.job, self.report, self.teacher_spec))
        D.barrier(self.env)

    def finish(self, seconds: float, stop: Optional[StopRequest] = None) -> RunResult:
        """Write the final model folder (with the teacher comparison) and the curves; return the last and best
        metrics, so the caller and the quickstart table need not read the folder back."""
        epochs = self.monitor.epochs() if self.env.is_main else []
        last = epochs[-1] if epochs else None
        metrics: dict[str, Any] = {"best_top1": self.pos.best_top1, "best_epoch": self.pos.best_epoch,
                                   "epochs": self.recipe.schedule.epochs, "seconds": seconds}
        if last is not None:
            metrics.update({"top1": last["val_top1"], "top5": last["val_top5"], "loss": last["val_loss"],
                            "n": last.get("val_n"), "classes": self.num_classes})
        self.task.close()  # hooks off: the comparison puts its own on the same modules
        card = {**card_metrics(self.recipe, last, self.pos.best_top1, self.pos.best_epoch),
                "train_seconds": round(seconds, 1)} if last is not None else {}
        self.write_model(self.run_dir, card, final=True, stop=stop)
        if self.env.is_main:
            plot_curves(self.run_dir)
        self.monitor.close()
        return RunResult(self.run_dir, metrics, seconds)


def run(job: DistillJob, on_step: Optional[Callable[[Trainer], None]] = None) -> RunResult:
    """Distill ``job.student`` from its teacher per ``job.recipe`` into the run folder ``job.out``."""
    check_run_folder(Path(job.out), job.resume, job.force, job_inputs(job.student, job.teacher, job.recipe))
    env = D.setup(job.device)
    try:
        # one run per folder: a second distill (or resume) into it is refused while this one runs
        with output_lock(job.out) if env.is_main else contextlib.nullcontext():
            guard = RunGuard(Path(job.out), job.resume, env)
            ok = False
            try:
                result = Trainer(job, env).fit(on_step)
                ok = True
                return result
            finally:
                guard.done(ok)
    finally:
        D.teardown(env)
