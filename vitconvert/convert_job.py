"""``convert_source``: what ``vitconvert convert`` does, as one library call (a SOURCE string -> a model folder).

The command line only parses and prints around it, as ``hf download`` wraps ``snapshot_download``. Every
argument is checked here, once and before any slow work (a download, a measurement), as ``BadValue(name, ...)``
with the parameter's own name; the output folder is refused before the source is loaded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from .conversion import ConversionReport, check_request, convert
from .errors import BadValue, param
from .folder import check_options, save
from .hybrid import LayerChoice, choose_softmax_layers
from .loading import model_threads
from .selection import Spec, auto_count
from .sources import Source, lasting_spec, load_source
from .writer import check_output

# ``progress(what)`` wraps each slow stage ("loading deit_small", "writing out"): a heartbeat, a log line, a bar
Progress = Callable[[str], AbstractContextManager[Any]]


@dataclass
class ConvertResult:
    """What ``convert_source`` wrote and did: the folder, the source's architecture, the conversion report,
    the hybrid layer choice (``keep_softmax="auto:K"``) and the seconds the work took."""

    out: Path
    arch: str
    report: ConversionReport
    pretrained: bool
    selection: Optional[dict[str, Any]] = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The command's ``--json`` line: the folder, the seconds and the report."""
        return {"out": str(self.out), "seconds": round(self.seconds, 3), **self.report.to_dict()}


def check_arguments(source: str, to: str, out: Optional[Union[str, Path]], *, num_classes: Optional[int],
                    img_size: Optional[int], options: Optional[dict[str, Any]], keep_softmax: Spec,
                    data: Optional[str], force: bool) -> None:
    """Everything that can be refused without the model, refused before loading it."""
    check_request(to, num_classes)
    if img_size is not None and img_size < 1:
        raise BadValue("img_size", f"must be at least 1 (got {img_size})")
    auto = auto_count(keep_softmax) is not None
    if data is None and auto:
        raise BadValue("data", f"needed by {param('keep_softmax', 'auto:K')}: the layers are measured on a few "
                               "batches of it")
    if data is not None and not auto:
        raise BadValue("data", f"is read only by {param('keep_softmax', 'auto:K')} (the layers are measured on "
                               f"it); drop it, or add {param('keep_softmax', 'auto:K')}")
    if out is not None:  # refuse before the work, not after it
        check_output(out, force=force, inputs=[source])
    check_options(to, options or {})


def load_seeded(source: str, seed: int, *, pretrained: bool, arch: Optional[str],
                img_size: Optional[int]) -> Source:
    """The source model; a random-init one (``pretrained=False``) is drawn from ``seed``, so that
    ``loading.load_teacher`` can rebuild the same teacher from the folder's ``source_seed``."""
    kwargs = {"img_size": img_size} if img_size is not None else {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return load_source(source, pretrained=pretrained, arch=arch, **kwargs)


def convert_source(
    source: str,
    to: str,
    out: Optional[Union[str, Path]] = None,
    *,
    attn_init: str = "mimetic",
    mlp_init: str = "copy",
    rest_init: str = "copy",
    seed: int = 0,
    num_classes: Optional[int] = None,
    pretrained: bool = True,
    arch: Optional[str] = None,
    img_size: Optional[int] = None,
    options: Optional[dict[str, Any]] = None,
    layers: Spec = None,
    keep_softmax: Spec = None,
    data: Optional[str] = None,
    signal: str = "logit-kl",
    data_dir: Optional[str] = None,
    download: bool = False,
    force: bool = False,
    progress: Optional[Progress] = None,
    threads: Optional[int] = None,
) -> ConvertResult:
    """Load ``source`` (any SOURCE string), convert it to ``to`` and save the model folder ``out`` (default
    ``./<arch>-<to>``), atomically; ``force`` replaces a folder vitconvert wrote.

    ``layers`` / ``keep_softmax`` make a hybrid (``"2-11"``, ``"0,1"``); ``keep_softmax="auto:K"`` keeps the K
    layers that lose most as linear, measured on ``data`` by ``signal`` (``hybrid.choose_softmax_layers``).
    ``threads``: torch's CPU threads meanwhile (``loading.model_threads``, as ``vitconvert convert --threads``).
    The other arguments are ``convert``'s and ``sources.load_source``'s.

    Example: ``vitconvert.convert_source("deit_small", "mhla", "deit_small-mhla")``
    """
    stage = progress or (lambda what: nullcontext())
    options = options or {}
    check_arguments(source, to, out, num_classes=num_classes, img_size=img_size, options=options,
                    keep_softmax=keep_softmax, data=data, force=force)
    with model_threads(threads, source):  # as the command: 1 thread for a small model, unless told
        start = time.perf_counter()
        with stage(f"loading {source}"):
            src = load_seeded(source, seed, pretrained=pretrained, arch=arch, img_size=img_size)
        if out is None:
            out = check_output(f"{src.arch}-{to}", force=force, inputs=[source])
        meta: dict[str, Any] = {"source_seed": seed} if not src.pretrained else {}  # loading.load_teacher rebuilds it
        if img_size is not None:
            meta["source_img_size"] = img_size
        if arch is not None:  # a bare weights file: its teacher is rebuilt with the architecture it was read with
            meta["source_arch"] = src.arch
        count = auto_count(keep_softmax)
        if count is not None:
            with stage(f"measuring which {count} layer(s) to keep softmax on {data}"):
                choice: LayerChoice = choose_softmax_layers(src.model, to, count, data, signal=signal, options=options,
                                                            seed=seed, data_dir=data_dir, download=download)
            keep_softmax, meta["selection"] = ",".join(map(str, choice.keep)), {**choice.to_dict(), "data": data}
        with stage(f"converting to {to} ({attn_init} attention init)"):
            student, report = convert(src.model, to, attn_init=attn_init, mlp_init=mlp_init, rest_init=rest_init,
                                      seed=seed, num_classes=num_classes, options=options,
                                      source=lasting_spec(source),
                                      layers=layers, keep_softmax=keep_softmax or None)
        if not report.surgery.layers:
            raise BadValue("keep_softmax", "keeps every layer softmax: that is the source model itself; keep fewer")
        with stage(f"writing {out}"):
            save(student, out, force=force, inputs=[source], pretrained=src.pretrained, **meta)
        seconds = time.perf_counter() - start
        return ConvertResult(Path(out), src.arch, report, src.pretrained, meta.get("selection"), seconds)
