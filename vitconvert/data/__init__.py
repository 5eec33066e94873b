"""Data, the bottom layer beside ``attention/``: datasets, the bundled digits, transforms, reproducible loaders.

Shared by ``eval``, ``compare`` and ``distill``; it knows nothing of models beyond their input size and
normalisation.
"""

from .datasets import (
                       EVAL_FOLDERS,
                       EXTRA_TORCH,
                       TIMM_PREFIXES,
                       TRAIN_SPLITS,
                       align_classes,
                       check_classes,
                       class_names,
                       dataset_classes,
                       is_train_split,
                       open_dataset,
                       open_folder,
                       open_named,
)
from .digits import DigitsDataset, digits_arrays, digits_dataset, export_imagefolder
from .loaders import (
                       ClosingLoader,
                       EpochBatchSampler,
                       RunData,
                       TransformedDataset,
                       default_workers,
                       end_on_sigterm_from,
                       ignore_interrupts,
                       make_loader,
                       run_data,
                       sample_rng,
                       set_epoch,
)
from .transforms import (
                       InputConfig,
                       accepts_size,
                       eval_transform,
                       input_config,
                       mixup_for,
                       model_input_size,
                       size_text,
                       teacher_normalizer,
                       train_transform,
)

__all__ = [
    "EVAL_FOLDERS", "EXTRA_TORCH", "TIMM_PREFIXES", "TRAIN_SPLITS", "ClosingLoader", "DigitsDataset",
    "EpochBatchSampler", "InputConfig", "RunData", "TransformedDataset", "accepts_size", "align_classes",
    "check_classes", "class_names",
    "dataset_classes", "default_workers", "digits_arrays", "digits_dataset", "end_on_sigterm_from",
    "eval_transform", "export_imagefolder", "ignore_interrupts", "input_config", "is_train_split", "make_loader",
    "mixup_for", "model_input_size", "open_dataset", "open_folder", "open_named", "run_data", "sample_rng",
    "set_epoch", "size_text", "teacher_normalizer", "train_transform",
]
