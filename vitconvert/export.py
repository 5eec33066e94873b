"""Export a model folder to ONNX or a PyTorch ExportedProgram (.pt2), checked against PyTorch on real images.

ONNX goes through torch's dynamo exporter (``torch.onnx.export(..., dynamo=True)``), the exporter torch now
recommends: it handles every variant's ops (the TorchScript-based one has no ONNX form of ``aten::exp2`` and
``aten::rms_norm``, which ELU and MHLA use). The check runs the exported file the way a deployment would
(ONNX Runtime, or ``torch.export.load``) on a few of the bundled digits images through the model's own eval
transform, and refuses a file whose logits are further than ``tolerance`` (relative) from PyTorch's. The file
carries what a deployment needs to use it (``file_metadata``: variant, linear layers, class names, preprocessing)
as ONNX ``metadata_props`` or .pt2 extra files.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from .attention import LinearAttention
from .data import digits_dataset
from .errors import BadValue, VitconvertError, first_line, param
from .loading import load, model_threads
from .provenance import report_of
from .sources import Resolved, below_a_patch, resolve, smaller_than_a_patch
from .surgery import linear_layer_indices
from .version import __version__
from .writer import MARK, atomic_file, check_file, output_lock

FORMATS = {"onnx": ".onnx", "pt2": ".pt2"}
DEFAULT_OPSET = 18  # the dynamo exporter's own default and oldest well-supported opset
TOLERANCE = 1e-4
EXPORT_EXTRA = "pip install 'vitconvert[export]'  (onnx, onnxscript, onnxruntime)"


@dataclass
class ExportResult:
    path: str
    format: str
    img_size: int
    batch_size: int
    dynamic_batch: bool
    rel_error: float  # max |exported - torch| / max |torch| over the check images
    checked_batches: list[int]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """The result as ``export --json`` prints it."""
        return asdict(self)


def require_onnx() -> None:
    """One line naming the extra when the ONNX packages are missing (they are optional)."""
    missing = [name for name in ("onnx", "onnxscript", "onnxruntime") if not _importable(name)]
    if missing:
        raise VitconvertError(f"ONNX export needs {', '.join(missing)}: {EXPORT_EXTRA}")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def default_output(source: Resolved, fmt: str) -> Path:
    """Next to a local folder, never inside it: ``runs/x-mhla`` -> ``runs/x-mhla.onnx`` (the folder stays as
    pushed); a Hub repo, a timm name or the bundled model: its name in the working directory (``digits.onnx``)."""
    if source.repo_id is not None:
        return Path(source.repo_id.split("/")[-1] + FORMATS[fmt])
    if source.path is None or source.bundled:
        return Path(source.spec + FORMATS[fmt])
    return source.path.parent / f"{source.path.name}{FORMATS[fmt]}"


def load_for_export(source: Union[str, Path, Resolved], img_size: Optional[int] = None,
                    pretrained: bool = True) -> nn.Module:
    """The model ``source`` names (anything ``vitconvert.load`` takes) in eval mode, rebuilt at ``img_size``
    (position embeddings resampled) when given."""

    model = load(source, pretrained=pretrained)
    if img_size is not None and img_size != model_img_size(model):
        if not hasattr(model, "set_input_size"):
            raise VitconvertError(f"{type(model).__name__} cannot change its input size")
        try:
            model.set_input_size(img_size=img_size)
        except RuntimeError as e:
            if not below_a_patch(e):
                raise
            raise smaller_than_a_patch(img_size, source.spec if isinstance(source, Resolved) else source) from None
    return model.eval()


def model_img_size(model: nn.Module) -> int:
    """The image size the model was built for: the export's default input size."""
    size = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if size is None:
        return int(model.pretrained_cfg.get("input_size", (3, 224, 224))[-1])
    return int(size[-1] if isinstance(size, (tuple, list)) else size)


def data_config(model: nn.Module, img_size: int) -> dict[str, Any]:
    """The model's eval preprocessing at ``img_size``, as timm resolves it (what the check runs and the file
    records)."""
    from timm.data import resolve_data_config

    return resolve_data_config({"input_size": (3, img_size, img_size)}, model=model)


def check_images(model: nn.Module, count: int, img_size: int) -> torch.Tensor:
    """``count`` real images (the bundled digits' validation set, cycled) through the model's eval transform."""
    from timm.data import create_transform

    transform = create_transform(**data_config(model, img_size), is_training=False)
    data = digits_dataset("val")
    return torch.stack([transform(data.image(i % len(data))) for i in range(count)])


def relative_error(got: Any, want: torch.Tensor) -> float:
    """The largest difference from the eager model, relative to its largest logit: the export's check."""
    got = torch.as_tensor(got, dtype=torch.float32)
    scale = want.abs().max().item() or 1.0
    return (got - want).abs().max().item() / scale


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """torch.onnx prints progress lines and warnings, and dynamo logs a failed trace as a 150-line traceback
    (through ``logging``); the command prints its own summary, or one line."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        logging.disable(logging.CRITICAL)
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)


def export(folder: Union[str, Path], fmt: str = "onnx", out: Optional[Union[str, Path]] = None,
           img_size: Optional[int] = None, batch_size: int = 2, dynamic_batch: bool = True,
           opset: Optional[int] = None, force: bool = False, tolerance: float = TOLERANCE,
           pretrained: bool = True, threads: Optional[int] = None) -> ExportResult:
    """Export the model ``folder`` names (a vitconvert model or run folder, or any SOURCE ``vitconvert.load``
    takes) to ``out`` (default: beside a local folder, else in the working directory), check it, and write it
    only if it passes.

    ``dynamic_batch`` (the default): any batch size at run time, checked at ``batch_size`` and one more; the
    trace uses a batch of at least 2 (torch.export fixes a dimension it sees as 1). ``threads``: torch's CPU threads
    meanwhile (``loading.model_threads``, as ``vitconvert export --threads``)."""
    import time

    if fmt not in FORMATS:
        raise BadValue("fmt", f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    if batch_size < 1:
        raise BadValue("batch_size", f"must be at least 1 (got {batch_size})")
    if opset is not None and fmt != "onnx":
        raise BadValue("opset", f"applies to ONNX only, not to {param('fmt', fmt)}")
    if opset is not None and not 18 <= opset <= 23:
        raise BadValue("opset", f"{opset} is not supported by the dynamo exporter: choose 18 to 23")
    if img_size is not None and img_size < 1:  # before the model loads (minutes for a large one)
        raise BadValue("img_size", f"must be at least 1 (got {img_size})")
    if fmt == "onnx":
        require_onnx()
    source = resolve(folder)
    inputs = [source.path or folder]
    target = check_file(out if out is not None else default_output(source, fmt), force=force, inputs=inputs,
                        suffix=FORMATS[fmt])
    started = time.perf_counter()
    # from before the minutes of export: a second export to this file is refused; threads as the command's
    with output_lock(target), model_threads(threads, folder):
        model = load_for_export(source, img_size, pretrained)
        size = model_img_size(model)
        batches = [batch_size, batch_size + 1] if dynamic_batch else [batch_size]
        images = check_images(model, max(*batches, 2), size)
        with torch.no_grad():
            expected = {b: model(images[:b]) for b in batches}
        with atomic_file(target, force=force, inputs=inputs, suffix=FORMATS[fmt]) as tmp:
            # dynamic: traced at batch 2 (any batch runs; a 5000-image trace only costs memory), checked at batch_size
            example = images[:2] if dynamic_batch else images[:batch_size]
            metadata = file_metadata(model, size)
            if fmt == "onnx":
                export_onnx(model, example, tmp, dynamic_batch, opset or DEFAULT_OPSET, metadata, largest=max(batches))
                run = _onnx_runner(tmp)
            else:
                _export_pt2(model, example, tmp, dynamic_batch, metadata, largest=max(batches))
                run = _pt2_runner(tmp)
            error = max(relative_error(run(images[:b]), expected[b]) for b in batches)
            if not math.isfinite(error) or error > tolerance:
                raise VitconvertError(f"the exported model's logits differ from PyTorch's by {error:.2e} "
                                      f"(relative), more than {tolerance:g}: not written")
    return ExportResult(str(target), fmt, size, batch_size, dynamic_batch, error, batches,
                        time.perf_counter() - started)


META_PREFIX = "vitconvert_"  # the keys an exported file records, beside the writer's MARK (vitconvert's version)


def file_metadata(model: nn.Module, img_size: int) -> dict[str, str]:
    """What an exported file says of itself, so a deployment needs no other file: the attention variant and its
    options ("softmax" for a softmax source), which layers are linear (of how many), the class names (an empty
    list where the model records none; num_classes 0: a headless model, whose output is features) and the eval
    preprocessing. Strings (ONNX ``metadata_props``, .pt2 extra files); lists and dicts as JSON."""
    linear, depth = linear_layer_indices(model)
    found = [m for m in model.modules() if isinstance(m, LinearAttention)]
    preprocessing = {k: list(v) if isinstance(v, tuple) else v for k, v in data_config(model, img_size).items()}
    values = {
        "variant": found[0].variant if found else "softmax",
        "options": json.dumps(found[0].options if found else {}),
        "linear_layers": json.dumps(linear),
        "depth": str(depth),
        "num_classes": str(getattr(model, "num_classes", "")),
        "class_names": json.dumps(list(model.pretrained_cfg.get("label_names") or [])),
        "preprocessing": json.dumps(preprocessing),
        "source": str(report_of(model).get("source") or ""),
        "io": "input pixel_values: float32 [batch, 3, H, W], preprocessed; output logits: " + (
            "[batch, num_classes]" if getattr(model, "num_classes", 0) else "[batch, num_features], image features"),
    }
    return {META_PREFIX + k: v for k, v in values.items()}


def _batch_dims(dynamic_batch: bool, largest: int = 1) -> Optional[tuple[dict[int, Any]]]:
    """The batch dimension, dynamic from 1 to at least 4096 and to the largest batch the export is checked at."""
    return ({0: torch.export.Dim("batch", min=1, max=max(4096, largest))},) if dynamic_batch else None


def export_onnx(model: nn.Module, example: torch.Tensor, path: Path, dynamic_batch: bool = False,
                opset: int = DEFAULT_OPSET, metadata: Optional[dict[str, str]] = None, largest: int = 1) -> None:
    """``model`` as ONNX at ``path`` (input ``pixel_values``, output ``logits``), by the dynamo exporter;
    ``metadata`` goes into the model's ``metadata_props``."""
    try:
        with quiet():
            program = torch.onnx.export(model, (example,), dynamo=True, opset_version=opset,
                                        input_names=["pixel_values"], output_names=["logits"],
                                        dynamic_shapes=_batch_dims(dynamic_batch, largest), external_data=False)
            program.model.metadata_props.update(metadata or {})
            program.model.metadata_props[MARK] = __version__  # writer.written_file: --force may replace it
            program.save(str(path))
    except Exception as e:  # an exporter failure is about this model, not a vitconvert bug to trace
        raise VitconvertError(f"ONNX export failed: {type(e).__name__}: {first_line(e)}") from None


def _onnx_runner(path: Path) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda x: session.run(None, {name: x.numpy()})[0]


def _export_pt2(model: nn.Module, example: torch.Tensor, path: Path, dynamic_batch: bool,
                metadata: dict[str, str], largest: int = 1) -> None:
    try:
        with quiet():
            program = torch.export.export(model, (example,), dynamic_shapes=_batch_dims(dynamic_batch, largest))
            buffer = io.BytesIO()  # torch.export.save wants a name ending in .pt2, not our temporary one
            torch.export.save(program, buffer, extra_files={**metadata, MARK: __version__})  # MARK: written_file's
            path.write_bytes(buffer.getvalue())
    except Exception as e:
        raise VitconvertError(f"torch.export failed: {type(e).__name__}: {first_line(e)}") from None


def _pt2_runner(path: Path) -> Any:
    program = torch.export.load(io.BytesIO(path.read_bytes()))  # our own file, written a moment ago
    module = program.module()

    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return module(x)

    return run
