"""The distill loop, as plain as timm's train.py: teacher forward, student forward, loss, step; repeat.

The Trainer owns the state the loop shares (models, optimizer, EMA, position) and the moments it is saved:
best/ when validation improves, checkpoint-last/ at each epoch end and on a stop signal.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch

from .. import data, loading
from .. import distributed as D
from ..errors import VitconvertError, load_reason
from ..evaluate import eval_sums, metrics_from_sums
from ..recipes import Recipe, recipe_changes, recipe_summary
from ..writer import output_lock
from . import models
from . import param_groups as groups
from .checkpoint import CHECKPOINT, Position, read_checkpoint, restore_rng, rng_state, seed_everything, write_checkpoint
from .final_compare import compare_at_end
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
from .signals import StopRequest, TrainingStopped
from .task import DistillationTask

TERMS = ("loss", "task", "attn", "kd")  # the running sums: each term × images, then the image count


@dataclass
class DistillJob:
    """One distill run: the student folder, the recipe, where to write, and how to run (not what to learn)."""

    student: str
    recipe: Recipe
    out: Path
    recipe_text: str = ""
    teacher: Optional[str] = None
    resume: bool = False
    force: bool = False
    device: Optional[str] = None
    fsdp: bool = False
    compile: bool = False
    show: bool = True  # epoch lines, and a progress bar on a terminal, on stderr


@dataclass
class RunResult:
    folder: Path
    metrics: dict[str, Any]  # final validation (fractions), best top-1 and its epoch
    seconds: float


class Trainer:
    """The loop around a :class:`DistillationTask`, read top to bottom as torchtune's recipes are: set up the
    models, the data, the run folder and the optimizer, then ``fit``."""

    def __init__(self, job: DistillJob, env: D.DistEnv):
        self.recipe, self.job, self.env, self.run_dir = job.recipe, job, env, Path(job.out)
        self._setup_models()
        self._setup_data()
        self._setup_run_folder()
        self._setup_optimizer()
        keep = (self.pos.epoch, self.pos.step) if self.ckpt is not None else None
        self.monitor = Monitor(self.run_dir, env.is_main, keep_until=keep)
        self.bar = Bar(job.show and env.is_main)
        self.stage, self.frozen = "", frozenset()
        self.epoch_sums = self.window = self.sums_tensor([])
        self.window_start = time.perf_counter()
        if job.compile:
            self.task.model.compile()

    # -- setup ----------------------------------------------------------------------------------------
    def _setup_models(self) -> None:
        """Student and teacher loaded and checked against each other and the recipe; the task built around them."""
        r, job, env = self.recipe, self.job, self.env
        student = loading.load_student(job.student)
        self.report = dict(getattr(student, "vitconvert_report", {}))
        self.teacher_spec = loading.teacher_spec(student, job.teacher or self.resumed_teacher())
        teacher = loading.load_teacher(self.teacher_spec, student, r.seed, recorded=job.teacher is None)
        models.check_kd(student, teacher, r.kd_weight)
        self.inp = data.input_config(student, r)
        models.check_sizes(student, teacher, self.inp.img_size)
        if job.fsdp and (r.ema or "attn" in [s for s, _ in r.stage_plan()] or r.freeze_copied_epochs):
            raise VitconvertError("--fsdp trains every parameter without EMA: drop ema, the attn stage and "
                                  "freeze_copied_epochs, or run without --fsdp (DDP)")
        self.num_classes = int(student.num_classes)
        models.set_drop_path(student, r.resolved_drop_path(models.embed_width(student)))
        self.export = copy.deepcopy(student).eval()  # a CPU copy that folders are written from, never trained
        models.export_config(self.export, self.inp)
        self.channels_last = env.device.type == "cuda"
        memory = torch.channels_last if self.channels_last else torch.preserve_format
        student.to(env.device, memory_format=memory)
        teacher.to(env.device, memory_format=memory)
        self.task = DistillationTask(student, teacher, r, env.device, data.teacher_normalizer(self.inp, teacher,
                                                                                               env.device),
                                     mixup_active=r.mixup > 0 or r.cutmix > 0)
        self.attn_ids = models.attention_param_ids(self.task.attention)
        self.frozen_ids = groups.frozen_ids(student, r)
        for epoch in range(r.epochs):  # a stage with nothing to train would fail in backward(), epochs later
            self.trainable(epoch)

    def _setup_data(self) -> None:
        env = self.env
        self.feed = data.run_data(self.recipe, self.inp, self.num_classes, env.rank, env.world,
                                  env.device.type == "cuda")
        self.labels_checked = self.feed.labels_checked

    def _setup_run_folder(self) -> None:
        """A new run folder, or the checkpoint of the one being resumed (its weights into the student)."""
        job = self.job
        self.pos = Position()
        self.ckpt = prepare_run_folder(self.run_dir, self.recipe, job.recipe_text, job.resume, job.force, self.env,
                                       job_inputs(job.student, job.teacher, self.recipe))
        if self.ckpt is not None:
            self.ckpt.check_same_job(self.job_record(), job.force)
            self.pos = self.ckpt.position
            try:
                self.task.model.load_state_dict(self.ckpt.model())
            except RuntimeError as e:  # a checkpoint of another architecture (written before the job record)
                raise VitconvertError(f"{self.run_dir / CHECKPOINT} does not fit the student {job.student}: "
                                      f"{load_reason(e)}; resume with the run's own student") from None

    def resumed_teacher(self) -> Optional[str]:
        """Resuming without --teacher: the teacher the run was started with (recorded in its checkpoint)."""
        if not self.job.resume:
            return None
        saved = read_checkpoint(self.run_dir).meta.get("job")
        return saved.get("teacher") if isinstance(saved, dict) else None

    def job_record(self) -> dict[str, Any]:
        """What a checkpoint records of who is trained from whom, for a resume to check."""
        student = {k: self.report.get(k) for k in ("variant", "layers", "depth", "source")}
        return {"teacher": self.teacher_spec, "student": student, "student_path": str(Path(self.job.student).resolve())}

    def _setup_optimizer(self) -> None:
        """Optimizer, schedule, loss scaler and EMA from timm's factories (FSDP shards before the optimizer)."""
        from timm.utils import ModelEmaV3

        r, task = self.recipe, self.task
        if self.job.fsdp:
            task.runner = D.shard(task.student, self.env, tuple({type(m) for m in task.attention}))
        self.optimizer, self.scheduler = groups.create_optimization(task.model, r, self.feed.updates_per_epoch)
        fp16 = self.env.device.type == "cuda" and r.amp and r.amp_dtype == "float16"
        self.scaler = torch.amp.GradScaler("cuda") if fp16 else None
        self.ema = ModelEmaV3(task.model, decay=r.ema_decay) if r.ema else None
        if self.ckpt is not None and self.ema is not None and self.ckpt.ema() is not None:
            self.ema.module.load_state_dict(self.ckpt.ema())

    def trainable(self, epoch: int) -> set[int]:
        return groups.trainable_ids(self.recipe, epoch, self.task.model, self.attn_ids, self.frozen_ids)

    def enter_stage(self, epoch: int) -> None:
        """Stage ``attn`` trains attention parameters only, freeze_copied_epochs holds the copied ones still
        (requires_grad off: no gradient, no weight decay, no optimizer state); DDP is rebuilt over what trains."""
        self.stage, self.frozen = groups.phase(self.recipe, epoch)
        self.task.set_stage(self.stage)
        if self.job.fsdp:
            return
        trainable = self.trainable(epoch)
        for p in self.task.model.parameters():
            p.requires_grad_(id(p) in trainable)
        self.task.runner = self.task.student  # drop the old DDP wrapper before building the new one
        self.task.runner = D.replicate(self.task.student, self.env)

    def restore(self) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        ckpt, env = self.ckpt, self.env
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        saved = ckpt.optimizer()
        if len(saved["param_groups"]) != len(hyper):
            raise VitconvertError(f"the checkpoint's optimizer has {len(saved['param_groups'])} parameter groups, "
                                  f"this recipe makes {len(hyper)}: new_params and layer_decay cannot change "
                                  "mid-run; start over (--force without --resume)")
        set_optimizer_state_dict(self.task.student, self.optimizer, saved,
                                 options=StateDictOptions(full_state_dict=True))
        if recipe_changes(ckpt.recipe, self.recipe):  # --resume --force: the new recipe's settings and schedule
            for group, values in zip(self.optimizer.param_groups, hyper, strict=True):
                group.update(values)
            self.scheduler.step(self.pos.epoch)
            self.scheduler.step_update(self.pos.step)
        else:
            self.scheduler.load_state_dict(ckpt.meta["scheduler"])
        if self.scaler is not None and ckpt.meta.get("scaler"):
            self.scaler.load_state_dict(ckpt.meta["scaler"])
        saved = ckpt.rng(env.rank) if ckpt.meta.get("world") == env.world else None
        if saved is None:
            self.bar.print(f"note: the checkpoint was written by {ckpt.meta.get('world')} process(es), this run "
                           f"has {env.world}: training continues, but not bitwise as the original would have")
            seed_everything(self.recipe.seed + env.rank + 1000 * self.pos.epoch)
        else:
            restore_rng(saved)

    # -- the loop -------------------------------------------------------------------------------------
    def fit(self, on_step: Optional[Callable[[Trainer], None]] = None) -> RunResult:
        r, start = self.recipe, time.perf_counter()
        self.enter_stage(min(self.pos.epoch, r.epochs - 1))
        self.epoch_sums = self.sums_tensor(self.pos.epoch_sums if self.env.is_main else [])
        self.window = self.sums_tensor(self.pos.window_sums if self.env.is_main else [])
        self.bar.print(f"{'resuming' if self.ckpt is not None else 'distilling'} {self.job.student} from the teacher "
                       f"{self.teacher_spec} into {self.run_dir}")  # the student may not have been named
        for line in recipe_summary(r):
            self.bar.print(line)
        if self.ckpt is not None:
            self.restore()
            record_recipe(self.run_dir, r, self.ckpt, self.job.recipe_text, self.env)
        else:
            seed_everything(r.seed + self.env.rank)
        with StopRequest() as stop:
            for epoch in range(self.pos.epoch, r.epochs):
                if groups.phase(r, epoch) != (self.stage, self.frozen):
                    self.enter_stage(epoch)
                self.train_epoch(epoch, stop, on_step)
                self.end_epoch(epoch)
        return self.finish(time.perf_counter() - start)

    def sums_tensor(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values or [0.0] * (len(TERMS) + 1), dtype=torch.float64, device=self.env.device)

    def train_epoch(self, epoch: int, stop: StopRequest, on_step: Optional[Callable[[Trainer], None]]) -> None:
        r = self.recipe
        data.set_epoch(self.feed.train, epoch, self.pos.batch)
        self.task.student.train()
        self.window_start = time.perf_counter()
        self.bar.start(f"epoch {epoch + 1}/{r.epochs} {self.stage}", self.feed.updates_per_epoch,
                       self.pos.batch // r.accum_steps)
        try:
            for images, targets in self.feed.train:
                if self.pos.batch >= self.feed.micro_per_epoch:
                    break
                sync = (self.pos.batch + 1) % r.accum_steps == 0
                sums = self.micro_step(images, targets, sync)
                self.epoch_sums += sums
                self.window += sums
                self.pos.batch += 1
                if not sync:
                    continue
                self.optimizer_step()
                terms = self.log_step(epoch) if self.pos.step % r.log_interval == 0 else None
                self.bar.advance(terms)
                if on_step is not None:
                    on_step(self)
                if D.any_rank(self.env, stop.requested is not None):
                    self.save_checkpoint()
                    raise TrainingStopped(f"stopped by {stop.requested or 'a signal'} at epoch {epoch + 1}, step "
                                          f"{self.pos.step}; checkpoint saved in {self.run_dir / CHECKPOINT}: "
                                          "continue with --resume", stop.requested or "SIGINT")
        finally:
            self.bar.stop()
        if self.window[-1] > 0:
            self.log_step(epoch)

    def micro_step(self, images: torch.Tensor, targets: torch.Tensor, sync: bool) -> torch.Tensor:
        """Forward both models and backward one micro-batch; returns [loss, task, attn, kd] × images, images."""
        env, r = self.env, self.recipe
        images = images.to(env.device, non_blocking=True)
        targets = targets.to(env.device, non_blocking=True)
        if not self.labels_checked:
            if int(targets.max()) >= self.num_classes:
                raise VitconvertError(f"the data has labels up to {int(targets.max())} but the student's head has "
                                      f"{self.num_classes} classes: convert with --num-classes")
            self.labels_checked = True
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        if self.feed.mixup is not None:
            images, targets = self.feed.mixup(images, targets)
        with D.gradient_sync(self.task.runner, sync and env.distributed):
            out = self.task(images, targets)
            loss = out["loss"]
            scaled = loss / r.accum_steps
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        zero = loss.new_zeros(())
        values = torch.stack([loss.detach()] + [out.get(k, zero) for k in TERMS[1:]]).double()
        count = torch.tensor([images.shape[0]], dtype=torch.float64, device=env.device)
        return torch.cat([values * images.shape[0], count])

    def optimizer_step(self) -> None:
        from timm.utils import dispatch_clip_grad

        r = self.recipe
        if r.clip_grad:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            params = [p for p in self.task.model.parameters() if p.grad is not None]
            dispatch_clip_grad(params, r.clip_grad, mode=r.clip_mode)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.pos.step += 1
        self.scheduler.step_update(num_updates=self.pos.step)
        if self.ema is not None:
            self.ema.update(self.task.model, step=self.pos.step)

    # -- reporting ------------------------------------------------------------------------------------
    def check_finite(self, sums: torch.Tensor, epoch: int) -> None:
        if bool(torch.isfinite(sums).all()):
            return
        saved = read_checkpoint(self.run_dir).position.epoch if (self.run_dir / CHECKPOINT).is_dir() else None
        where = (f"the last good checkpoint ({self.run_dir / CHECKPOINT}, after epoch {saved}) is kept: resume from "
                 "it with a lower --lr or --set clip_grad=1.0" if saved is not None else "no checkpoint was written")
        raise VitconvertError(f"the loss became NaN or infinite at epoch {epoch + 1}, step {self.pos.step}; "
                              f"training stopped and {where}")

    def log_step(self, epoch: int) -> str:
        totals = D.all_sum(self.env, self.window)
        self.check_finite(totals, epoch)
        n = float(totals[-1])
        record: dict[str, Any] = {"kind": "step", "epoch": epoch + 1, "step": self.pos.step,
                                  **groups.logged_lrs(self.optimizer)}
        weights = self.task.weights
        active = {"loss": True, "task": bool(weights.task), "attn": bool(weights.attn), "kd": bool(weights.kd)}
        record.update({k: float(totals[i]) / n for i, k in enumerate(TERMS) if active[k]})
        record["img_s"] = n / max(time.perf_counter() - self.window_start, 1e-9)
        self.monitor.log(record)
        self.window.zero_()
        self.window_start = time.perf_counter()
        return " ".join(f"{k} {record[k]:.4f}" for k in TERMS if k in record) + f"  {record['img_s']:.0f} img/s"

    def validate(self) -> dict[str, Any]:
        r, env = self.recipe, self.env
        if self.ema is not None:
            forward: Callable[[torch.Tensor], torch.Tensor] = self.ema.module
        else:  # the module itself: FSDP shards in place, DDP's wrapper would sync buffers on every call
            forward = lambda x: self.task.student(x, capture=False)[0]  # noqa: E731
        self.task.student.eval()
        sums = D.all_sum(env, eval_sums(forward, self.feed.val, env.device, r.amp, self.channels_last, r.amp_dtype))
        self.task.student.train()
        sums[-1] /= env.world
        return metrics_from_sums(sums)

    def end_epoch(self, epoch: int) -> None:
        started = time.perf_counter()
        train = D.all_sum(self.env, self.epoch_sums)
        self.check_finite(train, epoch)
        val = self.validate()
        self.scheduler.step(epoch + 1)
        n = float(train[-1])
        record: dict[str, Any] = {"kind": "epoch", "epoch": epoch + 1, "step": self.pos.step, "stage": self.stage,
                                  **groups.logged_lrs(self.optimizer)}
        record.update({f"train_{k}": float(train[i]) / n for i, k in enumerate(TERMS)
                       if k == "loss" or float(train[i])})
        record.update({"val_top1": val["top1"], "val_top5": val["top5"], "val_loss": val["loss"], "val_n": val["n"],
                       "val_seconds": time.perf_counter() - started})
        self.monitor.log(record)
        improved = val["top1"] > self.pos.best_top1
        if improved:
            self.pos.best_top1, self.pos.best_epoch = val["top1"], epoch + 1
        self.pos.epoch, self.pos.batch = epoch + 1, 0
        self.epoch_sums.zero_()
        if improved:
            self.write_model(self.run_dir / "best", self.card_metrics(record))
        self.save_checkpoint()
        self.bar.print(f"epoch {epoch + 1}/{self.recipe.epochs} [{self.stage}] train loss {record['train_loss']:.4f}"
                       f"  val top1 {100 * val['top1']:.2f}%  top5 {100 * val['top5']:.2f}%  loss {val['loss']:.4f}")

    def card_metrics(self, record: dict[str, Any]) -> dict[str, Any]:
        return card_metrics(self.recipe, record, self.pos.best_top1, self.pos.best_epoch)

    # -- writing --------------------------------------------------------------------------------------
    def student_state(self) -> dict[str, torch.Tensor]:
        if self.ema is not None:
            return {k: v.detach().cpu().clone() for k, v in self.ema.module.state_dict().items()}
        state = D.full_model_state(self.task.runner, self.task.student)
        return {k.removeprefix("student."): v for k, v in state.items()}

    def write_model(self, folder: Path, metrics: dict[str, Any], final: bool = False) -> None:
        """A model folder of the evaluated weights (EMA when on) with the recipe and results in its card; the
        final one also with the per-layer comparison with the teacher (compare.json/.png, the card's table)."""
        state = self.student_state()
        if self.env.is_main:
            meta = {**self.report, "recipe": self.recipe.to_dict(), "metrics": metrics, "teacher": self.teacher_spec}
            if final and self.recipe.compare_batches:
                self.export.load_state_dict(state)
                meta["compare"] = compare_at_end(self.task.teacher.teacher, self.export, self.feed, self.inp,
                                                 self.recipe, self.env.device, self.run_dir, self.teacher_spec,
                                                 self.bar.print)
            write_model_folder(self.export, state, folder, meta, in_place=folder == self.run_dir)

    def save_checkpoint(self) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        D.reshard(self.task.student)
        optim = get_optimizer_state_dict(self.task.student, self.optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        model = D.full_model_state(self.task.runner, self.task.student)
        epoch_sums, window = D.all_sum(self.env, self.epoch_sums), D.all_sum(self.env, self.window)
        self.check_finite(torch.cat([epoch_sums, window]), self.pos.epoch)
        rng = D.gather(self.env, rng_state())
        if self.env.is_main:
            position = replace(self.pos, epoch_sums=epoch_sums.tolist(), window_sums=window.tolist())
            write_checkpoint(self.run_dir, model={k.removeprefix("student."): v for k, v in model.items()},
                             optimizer=optim, ema=self.ema.module.state_dict() if self.ema is not None else None,
                             scheduler=self.scheduler.state_dict(),
                             scaler=self.scaler.state_dict() if self.scaler is not None else {},
                             position=position, recipe=self.recipe.to_dict(), rng=rng, job=self.job_record())
        D.barrier(self.env)

    def finish(self, seconds: float) -> RunResult:
        epochs = self.monitor.epochs() if self.env.is_main else []
        last = epochs[-1] if epochs else None
        metrics: dict[str, Any] = {"best_top1": self.pos.best_top1, "best_epoch": self.pos.best_epoch,
                                   "epochs": self.recipe.epochs, "seconds": seconds}
        if last is not None:
            metrics.update({"top1": last["val_top1"], "top5": last["val_top5"], "loss": last["val_loss"],
                            "n": last.get("val_n")})
        self.task.close()  # hooks off: the comparison puts its own on the same modules
        card = {**self.card_metrics(last), "train_seconds": round(seconds, 1)} if last is not None else {}
        self.write_model(self.run_dir, card, final=True)
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


