"""Trace loaders (``load.py``), prefix interning (``intern.py``) and the shipped traces (``shipped.py``)."""

from stack.traces.shipped import SHIPPED, shipped

__all__ = ["SHIPPED", "shipped"]
