"""Checks on raw input before MLIR sees it: reject what is not MLIR, and what would crash MLIR's C++.

MLIR's recursive-descent text parser overflows its stack on deep nesting, its convolution parser
allocates in proportion to a dimension index, and the bindings abort when a diagnostic quotes an escaped
name that is not UTF-8. :func:`prevalidate` refuses such input with a one-line :class:`IngestError`.
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

from .errors import IngestError

MAX_TEXT_NESTING = 256           # bracket depth of MLIR text; MLIR's recursive parser overflows past ~2000
MAX_RANK = 64                    # largest dimension index accepted in convolution dim_numbers

_BYTECODE_MAGIC = b"ML\xefR"
_DEPTH_CHUNK = 1 << 22
_CONV_DIM_NUMBERS = re.compile(r"dim_numbers\s*=\s*\[[^\]\n]*\]\s*x\s*\[[^\]\n]*\]\s*->\s*\[[^\]\n]*\]")
_STRINGS_AND_COMMENTS = re.compile(r'"(?:[^"\\\n]|\\.)*"|//[^\n]*')
_STRING_LITERAL = re.compile(r'"(?:[^"\\\n]|\\.)*"')
_HIGH_ESCAPE = re.compile(r'\\[89A-Fa-f][0-9A-Fa-f]')
_ESCAPE_OR_TEXT = re.compile(r'\\[0-9A-Fa-f]{2}|\\.|[^\\]+')


def prevalidate(data: Any, source: str) -> str | bytes:
    """Reject input that is not MLIR, or that would crash MLIR's C++ parser, before parsing it."""
    if isinstance(data, (bytearray, memoryview)):
        data = bytes(data)
    if not isinstance(data, (str, bytes)):
        raise IngestError(source, f"expected MLIR text or bytes, got {type(data).__name__}")
    if isinstance(data, bytes):
        if data.startswith(_BYTECODE_MAGIC):
            if len(data) < 16:
                raise IngestError(source, "MLIR bytecode is truncated")
            return data
        if data[:2] == b"\x1f\x8b":
            raise IngestError(source, "is gzip-compressed; decompress it first")
        if data[:4] == b"PK\x03\x04":
            raise IngestError(source, "is a zip archive, not an MLIR file")
        if data.startswith(b"\xef\xbb\xbf"):
            data = data[3:]
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise IngestError(source, f"is neither MLIR text nor MLIR bytecode (byte {exc.start} is not UTF-8)"
                              ) from None
    elif data.startswith("\ufeff"):
        data = data[1:]
    if not data.strip():
        raise IngestError(source, "is empty")
    if "\x00" in data:
        raise IngestError(source, "is not MLIR text (contains NUL bytes)")
    depth = _nesting_depth(data)
    if depth > MAX_TEXT_NESTING:
        raise IngestError(source, f"brackets nest {depth} deep (more than {MAX_TEXT_NESTING}); "
                          "not a program hespas-ml can read")
    if _HIGH_ESCAPE.search(data):
        _check_string_escapes(data, source)
    if "dim_numbers" in data:
        # MLIR's convolution parser allocates memory in proportion to the largest dimension index.
        for m in _CONV_DIM_NUMBERS.finditer(data):
            big = [int(x) for x in re.findall(r"\d+", m.group(0)) if int(x) > MAX_RANK]
            if big:
                line = data.count("\n", 0, m.start()) + 1
                raise IngestError(source, f"line {line}: convolution dim_numbers name dimension {big[0]} "
                                  f"(more than {MAX_RANK})")
    return data


def _check_string_escapes(text: str, source: str) -> None:
    """Refuse string literals whose ``\\XX`` escapes spell bytes that are not UTF-8: when MLIR quotes
    such a name in a diagnostic, the bindings cannot convert the message and abort the process."""
    for m in _STRING_LITERAL.finditer(text):
        body = m.group(0)[1:-1]
        if "\\" not in body:
            continue
        raw = bytearray()
        for piece in _ESCAPE_OR_TEXT.finditer(body):
            tok = piece.group(0)
            if tok[0] != "\\":
                raw += tok.encode("utf-8")
            elif len(tok) == 3:
                raw.append(int(tok[1:], 16))
            else:
                raw += {"n": b"\n", "t": b"\t"}.get(tok[1], tok[1].encode("utf-8"))
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            line = text.count("\n", 0, m.start()) + 1
            raise IngestError(source, f"line {line}: a string literal's escapes spell bytes that are not UTF-8 "
                              f"({m.group(0)[:40]})") from None


def _nesting_depth(text: str) -> int:
    """Deepest nesting of ``( [ { <`` outside strings and comments (``->`` arrows ignored).

    Unmatched closers are forgiven (the depth is measured above the running minimum), so stray
    brackets never inflate the result; only real nesting does. Works in chunks to bound memory.
    """
    stripped = _STRINGS_AND_COMMENTS.sub("", text).replace("->", "-")
    deepest, level, floor = 0, 0, 0
    for start in range(0, len(stripped), _DEPTH_CHUNK):
        b = np.frombuffer(stripped[start:start + _DEPTH_CHUNK].encode("utf-8", "replace"), np.uint8)
        step = np.zeros(b.size, np.int64)
        for c in b"([{<":
            step[b == c] = 1
        for c in b")]}>":
            step[b == c] = -1
        levels = np.cumsum(step) + level
        floors = np.minimum.accumulate(np.minimum(levels, floor))
        deepest = max(deepest, int((levels - floors).max()))
        level, floor = int(levels[-1]), int(floors[-1])
    return deepest
