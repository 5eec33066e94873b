"""Why Hedgehog's feature map trails ReLU early (issue 38): its attention at conversion, and its curve.

Hedgehog's map starts as the identity, φ(x) = [softmax(x), softmax(−x)] over the d features of a query or key.
Whether that start is flat (every key weighed alike) is measurable before any training: this script converts the
digits teacher to each student (seed 0), and on the validation images compares each layer's attention weights
with the softmax teacher's: the row entropy (log N: uniform), the cross-entropy from the teacher's weights, and the
attention-output MSE the distillation trains on (summed over layers, as its loss). Then it distils each student
for a few epochs (batch 32, the quickstart recipe) and keeps the per-epoch curve. ``--init-scale S`` also runs
Hedgehog with its maps started at W = S·I (a sharper softmax) instead of I: the intervention that tests the cause.

    python benchmarks/budget_hedgehog.py --epochs 2 --init-scale 4,16
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from budget import BASE  # noqa: E402
from budget_spread import _curve  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "budget-hedgehog-start.jsonl"
# name -> (variant, convert options); "hedgehog" is elu with the learned map (relu with it is the same model)
STUDENTS: dict[str, tuple[str, dict[str, Any]]] = {
    "relu": ("relu", {}), "elu": ("elu", {}), "hedgehog": ("elu", {"feature_map": "hedgehog", "init_scale": 1.0}),
}


def student(name: str, scale: float, seed: int = 0) -> torch.nn.Module:
    """The converted student (default convert), Hedgehog's maps started at W = I (init_scale 1), then scaled to
    W = scale·I."""
    from vitconvert import convert
    from vitconvert.sources import load_source

    variant, options = STUDENTS[name]
    model, _ = convert(load_source("digits").model, to=variant, seed=seed, options=options or None, source="digits")
    with torch.no_grad():
        for learned in _maps(model):
            learned.weight.mul_(scale)
    return model


def _weights(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, N) attention weights of one layer on its input ``x``: softmax for a timm teacher layer, the
    normalised φ(q)·φ(k) for a kernel-attention student layer."""
    from vitconvert.attention import LinearAttention
    from vitconvert.attention.feature_maps import hedgehog_features

    if not isinstance(module, LinearAttention):
        B, N, _ = x.shape
        q, k, _ = module.qkv(x).reshape(B, N, 3, module.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = module.q_norm(q), module.k_norm(k)
        return torch.softmax(q @ k.transpose(-2, -1) * module.scale, dim=-1)
    q, k, _ = module.project(x)
    if module.feature_map_q is not None:
        phi_q, phi_k = hedgehog_features(module.feature_map_q(q)), hedgehog_features(module.feature_map_k(k))
    else:
        phi_q, phi_k = module.phi(q), module.phi(k)
    scores = phi_q @ phi_k.transpose(-2, -1)
    return scores / (scores.sum(-1, keepdim=True) + module.eps)


@torch.no_grad()
def start_state(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor,
                teacher: torch.nn.Module) -> dict[str, Any]:
    """A student's state (before or after training): top-1, the attention-output MSE summed over layers, and per
    layer the mean row entropy of the student's and teacher's weights and the cross-entropy H(teacher, student),
    in nats."""
    from vitconvert.capture import attention_pairs

    mine, theirs = attention_pairs(model, teacher)
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {id(m): [] for m in (*mine, *theirs)}
    hooks = [m.register_forward_hook(lambda m, a, out: seen[id(m)].append((a[0], out))) for m in (*mine, *theirs)]
    try:
        logits = model.eval()(images)
        teacher.eval()(images)
    finally:
        for h in hooks:
            h.remove()
    layers = []
    for s, t in zip(mine, theirs, strict=True):
        (xs, out_s), (xt, out_t) = seen[id(s)][0], seen[id(t)][0]
        ws, wt = _weights(s, xs).clamp_min(1e-12), _weights(t, xt).clamp_min(1e-12)
        layers.append({"mse": float(torch.mean((out_s - out_t) ** 2)),
                       "entropy_student": float(-(ws * ws.log()).sum(-1).mean()),
                       "entropy_teacher": float(-(wt * wt.log()).sum(-1).mean()),
                       "cross_entropy": float(-(wt * ws.log()).sum(-1).mean())})
    return {"top1": float((logits.argmax(-1) == labels).float().mean()), "attn_mse": sum(x["mse"] for x in layers),
            "uniform_entropy": math.log(xs.shape[1]), "layers": layers}


def val_batch() -> tuple[torch.Tensor, torch.Tensor, torch.nn.Module]:
    """All validation images of the digits (one tensor: 297 8×8 images) and the teacher."""
    from vitconvert.data.datasets import open_dataset
    from vitconvert.data.transforms import eval_transform, input_config
    from vitconvert.sources import load_source

    teacher = load_source("digits").model
    ds = open_dataset("digits", "validation")
    transform = eval_transform(input_config(teacher))
    pairs = [(transform(img), label) for img, label in (ds[i] for i in range(len(ds)))]
    return torch.stack([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs]), teacher


def _maps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every learned feature map of ``model`` (Hedgehog's, queries' and keys'), in module order."""
    return [learned for m in model.modules() for learned in (getattr(m, "feature_map_q", None),
                                                             getattr(m, "feature_map_k", None)) if learned is not None]


def map_shift(model: torch.nn.Module, scale: float) -> float:
    """How far training moved Hedgehog's maps from their start S·I: mean over maps of ‖W − S·I‖ / ‖S·I‖
    (Frobenius)."""
    shifts = []
    for m in _maps(model):
        start = scale * torch.eye(m.weight.shape[-1]).expand_as(m.weight)
        shifts.append(float((m.weight.detach() - start).norm() / start.norm()))
    return sum(shifts) / len(shifts)


def curve(name: str, scale: float, epochs: int, probe: tuple[torch.Tensor, torch.Tensor, torch.nn.Module],
          seed: int = 0) -> dict[str, Any]:
    """Distil the student (batch 32, the quickstart recipe, ``epochs``): its per-epoch curve, the trained
    student's attention against the teacher's (``probe``: validation images, labels, teacher) and, for Hedgehog,
    how far its maps moved and the same state with the maps put back to the identity (what the maps add)."""
    from vitconvert import load, save
    from vitconvert.distill import distill
    from vitconvert.distill.monitor import METRICS, read_records

    cpu = time.process_time()
    with tempfile.TemporaryDirectory(prefix="budget-hedgehog-") as tmp:
        model = student(name, scale, seed)
        torch.manual_seed(seed)
        save(model, Path(tmp) / "init", pretrained=True)
        overrides = {"epochs": epochs, "seed": seed, **BASE, "batch_size": 32}
        result = distill(Path(tmp) / "init", Path(tmp) / "run", recipe="quickstart", overrides=overrides,
                         show=False, device="cpu")
        records = read_records(Path(tmp) / "run" / METRICS)
        trained = load(Path(tmp) / "run")
    out = {"top1": result.metrics["top1"], "curve": _curve(records), "cpu_seconds": round(time.process_time() - cpu, 2),
           "end": start_state(trained, *probe)}
    if _maps(trained):
        out["map_shift"] = map_shift(trained, scale)
        for m in _maps(trained):
            m.reset_parameters()
        out["end_maps_reset"] = start_state(trained, *probe)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--students", default="relu,elu,hedgehog", help=f"from {', '.join(STUDENTS)}")
    parser.add_argument("--init-scale", default="", help="more starts of Hedgehog's maps: W = S·I, comma-separated")
    parser.add_argument("--epochs", type=int, default=2, help="the curve's budget (0: the start state only)")
    parser.add_argument("--seeds", default="0", help="conversion and training seed (as budget.py's)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = [(n, 1.0) for n in args.students.split(",") if n]
    runs += [("hedgehog", float(s)) for s in args.init_scale.split(",") if s]
    probe = val_batch()
    for seed, (name, scale) in ((int(seed), run) for seed in args.seeds.split(",") if seed for run in runs):
        rec: dict[str, Any] = {"student": name, "init_scale": scale, "epochs": args.epochs, "seed": seed,
                               "start": start_state(student(name, scale, seed), *probe)}
        if args.epochs:
            rec.update(curve(name, scale, args.epochs, probe, seed))
        with args.results.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        line = f"{name} (W = {scale:g}·I, seed {seed}): at conversion {_describe(rec['start'])}"
        if args.epochs:
            line += f"; per epoch {[e['val_top1'] for e in rec['curve']]}; trained {_describe(rec['end'])}"
        if "map_shift" in rec:
            line += (f"; maps moved {rec['map_shift']:.3f} of their start; put back to I: "
                     f"{_describe(rec['end_maps_reset'])}")
        print(line, flush=True)


def _describe(state: dict[str, Any]) -> str:
    def per_layer(key: str) -> list[float]:
        return [round(x[key], 2) for x in state["layers"]]

    return (f"top-1 {100 * state['top1']:.1f}, attention MSE {state['attn_mse']:.3f}, row entropy "
            f"{per_layer('entropy_student')} (teacher {per_layer('entropy_teacher')}, uniform "
            f"{state['uniform_entropy']:.2f}), CE {per_layer('cross_entropy')}")

if __name__ == "__main__":
    main()
