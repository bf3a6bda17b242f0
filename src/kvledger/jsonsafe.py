"""JSON without NaN or infinities: the one rule every JSON a user reads (``--json``, report files) follows.

Python's ``json`` writes ``NaN`` and ``Infinity``, which strict JSON readers (``jq``, browsers' ``JSON.parse``)
refuse; a figure that is not finite (a rate with nothing measured) is written as ``null`` instead.
"""

from __future__ import annotations

import math
from typing import Any


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float, however deep in dicts, lists and tuples, replaced by None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


__all__ = ["finite"]
