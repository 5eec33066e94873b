"""Top-5 accuracy says something only when there are more than 5 classes: with 3 the top 5 always hold the label, so
it would read 100% about nothing. One rule for eval's table and JSON, distill's lines and the model card: the score
is None (JSON null) there, and a reader sees ``n/a (3 classes)``."""

from __future__ import annotations

from typing import Any, Optional

TOP_K = 5


def top_k_score(hits: float, images: float, classes: int) -> Optional[float]:
    """The fraction of images whose label is among the TOP_K highest scores; None when every label always is."""
    return hits / images if classes > TOP_K else None


def top_k_text(score: Optional[float], classes: Any, scale: float = 100.0) -> str:
    """``99.10%`` (a fraction with ``scale`` 100, a percentage with 1), or ``n/a (3 classes)``."""
    return f"{scale * score:.2f}%" if score is not None else f"n/a ({classes} classes)"


def shown_score(name: str, value: Any, classes: Any) -> Any:
    """A results table's value (a model card's, in percent): an unmeasured top-5 as ``n/a (3 classes)``."""
    return top_k_text(value, classes) if name == "top5" and value is None else value
