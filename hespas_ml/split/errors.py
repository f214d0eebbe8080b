"""The error of the split stage."""
from __future__ import annotations

from ..ingest.errors import HespasError


class SplitError(HespasError):
    pass
