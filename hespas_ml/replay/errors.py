"""Exception classes of the replay stage (Chakra traces, system configs, replays).

Every message is one line that names the file, spec or rank concerned and the problem; the CLI turns
these exceptions into exit code 2.
"""
from __future__ import annotations

from ..ingest.errors import HespasError


class ReplayStageError(HespasError):
    """Base class of every error raised by `hespas_ml.replay`."""


class TraceError(ReplayStageError):
    """A Chakra ET file (or byte string) cannot be encoded or decoded."""


class SystemConfigError(ReplayStageError):
    """An ASTRA-sim system configuration (folder, file or short spec) is invalid."""


class ReplayError(ReplayStageError):
    """A replay cannot finish: deadlock, unsupported input, or a failing ASTRA-sim binary."""
