"""Errors raised while reading a program."""
from __future__ import annotations


class HespasError(Exception):
    """Base class of every error that the CLI reports as one clean line (exit code 2)."""


class IngestError(HespasError):
    """A program could not be read: ``source`` names the file (or zoo spec), ``message`` the problem."""

    def __init__(self, source: str, message: str):
        self.source = str(source)
        self.message = message
        super().__init__(f"{self.source}: {message}")
