"""The embedded default: real 8×8 digits and a small softmax ViT teacher trained on them, shipped in the package.

They make ``vitconvert quickstart`` (and the tests and benchmarks) work offline in minutes on a CPU.
The digits are scikit-learn's copy of the UCI handwritten digits (1797 images, 16 gray levels, public
domain), stored as uint8 with a fixed stratified split (``benchmarks/make_digits_data.py``); the teacher
is written by ``benchmarks/train_digits_teacher.py``.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import VitconvertError

ASSETS = Path(__file__).resolve().parent
DIGITS_FILE = ASSETS / "digits.npz"  # read by vitconvert.data.digits
TEACHER_DIR = ASSETS / "digits-teacher"


def teacher_folder() -> Path:
    """The bundled softmax ViT teacher (timm ``save_for_hf`` layout); ``load_source("digits")`` loads it."""
    if not (TEACHER_DIR / "config.json").is_file():
        raise VitconvertError(f"the bundled digits teacher is missing ({TEACHER_DIR}); reinstall vitconvert")
    return TEACHER_DIR
