"""gpu_check's distill section: the real distill trainer on synthetic images, stopped by SIGTERM and resumed."""

from __future__ import annotations

import json
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import timm
import torch
from gpu_check_plan import Plan, softmax_source
from PIL import Image

import vitconvert
from vitconvert.recipes import load_recipe
from vitconvert.sources import load_source

SYNTHETIC_CLASSES = 4


def synthetic_images(root: Path, per_class: int, classes: int = SYNTHETIC_CLASSES, size: int = 32) -> Path:
    """train/ and val/ of noise tinted by class: learnable, so the loss of a working run falls."""
    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("val", max(2, per_class // 8))):
        for c in range(classes):
            folder = root / split / f"c{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                tint = np.zeros(3, dtype=np.int16)
                tint[c % 3] = 150 if c < 3 else 0
                pixels = np.clip(rng.integers(0, 100, (size, size, 3)) + tint, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return root


def student_folder(root: Path, softmax: torch.nn.Module) -> Path:
    """A converted student whose recorded teacher is ``softmax`` saved as a local folder (no download)."""
    teacher = root / "teacher"
    timm.models.save_for_hf(softmax, str(teacher), safe_serialization=True)
    source = load_source(str(teacher))
    student, _ = vitconvert.convert(source.model, "elu", source=str(teacher))
    return vitconvert.save(student, root / "student", pretrained=True)


def distill(plan: Plan, device: torch.device) -> dict[str, Any]:
    """2 epochs of ``distill_steps`` steps; SIGTERM a fifth into the second epoch, then --resume to the end."""
    from vitconvert.distill import DistillJob, TrainingStopped, run

    steps = plan.distill_steps
    stop_at = steps + max(1, steps // 5)
    if steps * plan.distill_batch % SYNTHETIC_CLASSES:
        raise ValueError(f"distill_steps × distill_batch must be a multiple of {SYNTHETIC_CLASSES}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        softmax = softmax_source(plan, plan.models[0], plan.distill_size, num_classes=SYNTHETIC_CLASSES)
        student = student_folder(root, softmax)
        data = synthetic_images(root / "data", per_class=steps * plan.distill_batch // SYNTHETIC_CLASSES)
        overrides = {"data": str(data), "epochs": 2, "batch_size": plan.distill_batch, "warmup_epochs": 0,
                     "lr": 5e-4, "log_interval": 1, "workers": plan.workers, "rand_augment": None,
                     "color_jitter": None, "reprob": 0.0, "mixup": 0.0, "cutmix": 0.0, "drop_path": 0.0,
                     "compare_batches": 0, "amp": True, "amp_dtype": "bfloat16"}
        recipe, text = load_recipe(None, overrides)

        def job(resume: bool) -> DistillJob:
            return DistillJob(str(student), recipe, root / "run", text, resume=resume, device=str(device),
                              compile=plan.distill_compile, show=False)

        def stop(trainer) -> None:
            if trainer.pos.step == stop_at:
                signal.raise_signal(signal.SIGTERM)

        started = time.perf_counter()
        stopped = ""
        try:
            run(job(resume=False), on_step=stop)
        except TrainingStopped as e:
            stopped = str(e).split(";")[0]
        result = run(job(resume=True))
        records = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("kind") == "step"]
    speeds = [r["img_s"] for r in records if r.get("kind") == "step"][2:]  # past compilation
    window = max(1, len(losses) // 10)
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    final_step = max((r["step"] for r in records if r.get("kind") == "step"), default=0)
    return {"steps": final_step, "expected_steps": 2 * steps, "stopped": stopped, "resumed": bool(stopped),
            "first_loss": first, "last_loss": last, "loss_falls": last < first, "compile": plan.distill_compile,
            "amp": "bfloat16", "channels_last": device.type == "cuda", "batch": plan.distill_batch,
            "img_size": plan.distill_size, "img_s": sorted(speeds)[len(speeds) // 2] if speeds else None,
            "top1": result.metrics.get("top1"), "seconds": time.perf_counter() - started,
            "ok": bool(stopped) and final_step == 2 * steps and last < first}
