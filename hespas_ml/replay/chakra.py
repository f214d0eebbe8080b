"""Chakra execution-trace (ET) files: a dependency-free encoder and decoder.

An ET file is a plain (never gzipped) stream of protobuf messages of the `ChakraProtoMsg` package, each
preceded by its byte length as an unsigned base-128 varint.  The first message is `GlobalMetadata`
(field 1: version string), every later one is a `Node`.  Field numbers follow chakra's `et_def.proto`
(see shared/reference/astra-sim.md section 4):

    Node: id=1 (uint64), name=2, type=3 (NodeType), ctrl_deps=4, data_deps=5 (packed uint64),
          start_time_micros=6, duration_micros=7, inputs=8, outputs=9, attr=10 (AttributeProto)
    AttributeProto: name=1, doc_string=2, one value out of fields 3..32 (odd = scalar, even = list)

`EtNode.attrs` maps attribute names to Python values.  Encoding picks the protobuf variant from the
Python type (bool -> bool_val, int -> int64_val, str -> string_val, float -> double_val, bytes ->
bytes_val, list[bool] -> bool_list, list[int] -> int64_list, list[str] -> string_list, list[float] ->
double_list).  Decoding accepts every variant; all integer variants become `int`, like ASTRA-sim's
feeder reads them.  The file layout written here is the one python-protobuf writes (fields in number
order, proto3 defaults omitted, packed repeated scalars), so re-encoding a decoded file that was
written that way is byte-identical.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from hespas_ml.replay.errors import TraceError

# --- NodeType (et_def.proto) -------------------------------------------------------------------------
INVALID_NODE = 0
METADATA_NODE = 1
MEM_LOAD_NODE = 2
MEM_STORE_NODE = 3
COMP_NODE = 4
COMM_SEND_NODE = 5
COMM_RECV_NODE = 6
COMM_COLL_NODE = 7

NODE_TYPE_NAMES: dict[int, str] = {
    INVALID_NODE: "INVALID_NODE",
    METADATA_NODE: "METADATA_NODE",
    MEM_LOAD_NODE: "MEM_LOAD_NODE",
    MEM_STORE_NODE: "MEM_STORE_NODE",
    COMP_NODE: "COMP_NODE",
    COMM_SEND_NODE: "COMM_SEND_NODE",
    COMM_RECV_NODE: "COMM_RECV_NODE",
    COMM_COLL_NODE: "COMM_COLL_NODE",
}

# --- CollectiveCommType (et_def.proto) ---------------------------------------------------------------
ALL_REDUCE = 0
REDUCE = 1
ALL_GATHER = 2
GATHER = 3
SCATTER = 4
BROADCAST = 5
ALL_TO_ALL = 6
REDUCE_SCATTER = 7
REDUCE_SCATTER_BLOCK = 8
BARRIER = 9

COLLECTIVE_NAMES: dict[int, str] = {
    ALL_REDUCE: "ALL_REDUCE",
    REDUCE: "REDUCE",
    ALL_GATHER: "ALL_GATHER",
    GATHER: "GATHER",
    SCATTER: "SCATTER",
    BROADCAST: "BROADCAST",
    ALL_TO_ALL: "ALL_TO_ALL",
    REDUCE_SCATTER: "REDUCE_SCATTER",
    REDUCE_SCATTER_BLOCK: "REDUCE_SCATTER_BLOCK",
    BARRIER: "BARRIER",
}

DEFAULT_VERSION = "0.0.4"


@dataclass(slots=True)
class EtNode:
    """One Chakra ET node: its id, name, NodeType, dependencies, replay duration and attributes."""

    id: int
    name: str
    type: int
    data_deps: list[int]
    ctrl_deps: list[int]
    duration_micros: int = 0
    attrs: dict[str, Any] = field(default_factory=dict)


class RankTraces(Sequence):
    """Every rank's trace when the ranks run the same nodes: one ``template`` (rank 0's list), and for the
    positions where ranks hold different nodes (a collective over communicator groups) every rank's node
    (``variants``: position, node by rank). A rank's list is made when it is asked for, so thousands of
    ranks cost one trace; node objects are shared between ranks and must not be changed."""

    def __init__(self, template: list[EtNode], variants: list[tuple[int, list[EtNode]]], n_ranks: int):
        self.template, self.variants, self.n_ranks = template, variants, n_ranks

    def __len__(self) -> int:
        return self.n_ranks

    def __getitem__(self, rank):
        if isinstance(rank, slice):
            return [self[r] for r in range(*rank.indices(self.n_ranks))]
        if rank < 0:
            rank += self.n_ranks
        if not 0 <= rank < self.n_ranks:
            raise IndexError(f"rank {rank} of {self.n_ranks}")
        nodes = self.template.copy()
        for pos, per_rank in self.variants:
            nodes[pos] = per_rank[rank]
        return nodes


# --- wire-format primitives ----------------------------------------------------------------------------
_WT_VARINT, _WT_I64, _WT_LEN, _WT_I32 = 0, 1, 2, 5
_WIRE_NAMES = {0: "varint", 1: "64-bit", 2: "length-delimited", 3: "start-group", 4: "end-group", 5: "32-bit"}
_MASK64 = (1 << 64) - 1
_VARINT_CACHE: dict[int, bytes] = {}


def _varint(value: int) -> bytes:
    """Unsigned base-128 varint of `value` (negative values as 64-bit two's complement)."""
    cached = _VARINT_CACHE.get(value)
    if cached is not None:
        return cached
    v = value & _MASK64 if value < 0 else value
    if v > _MASK64:
        raise TraceError(f"integer {value} does not fit in 64 bits")
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    encoded = bytes(out)
    if 0 <= value < 1 << 20:
        _VARINT_CACHE[value] = encoded
    return encoded


def _tag(field_no: int, wire_type: int) -> bytes:
    return _varint((field_no << 3) | wire_type)


def _len_delimited(field_no: int, payload: bytes) -> bytes:
    return _tag(field_no, _WT_LEN) + _varint(len(payload)) + payload


# Node field tags, precomputed.
_T_ID, _T_NAME, _T_TYPE = _tag(1, _WT_VARINT), _tag(2, _WT_LEN), _tag(3, _WT_VARINT)
_T_CTRL, _T_DATA, _T_DUR, _T_ATTR = _tag(4, _WT_LEN), _tag(5, _WT_LEN), _tag(7, _WT_VARINT), _tag(10, _WT_LEN)

# Attribute value fields (scalar numbers; the list variant is the next number).
_DOUBLE, _FLOAT, _INT32, _INT64, _UINT32, _UINT64 = 3, 5, 7, 9, 11, 13
_SINT32, _SINT64, _FIXED32, _FIXED64, _SFIXED32, _SFIXED64 = 15, 17, 19, 21, 23, 25
_BOOL, _STRING, _BYTES = 27, 29, 31


def _encode_attr_value(name: str, value: Any) -> bytes:
    """Encoded AttributeProto body for one named Python value."""
    body = _len_delimited(1, name.encode("utf-8"))
    if isinstance(value, bool):
        return body + _tag(_BOOL, _WT_VARINT) + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        return body + _tag(_INT64, _WT_VARINT) + _varint(value)
    if isinstance(value, str):
        return body + _len_delimited(_STRING, value.encode("utf-8"))
    if isinstance(value, float):
        return body + _tag(_DOUBLE, _WT_I64) + struct.pack("<d", value)
    if isinstance(value, (bytes, bytearray)):
        return body + _len_delimited(_BYTES, bytes(value))
    if isinstance(value, (list, tuple)):
        items = list(value)
        if items and all(isinstance(v, bool) for v in items):
            packed = bytes(1 if v else 0 for v in items)
            return body + _len_delimited(_BOOL + 1, _len_delimited(1, packed))
        if all(isinstance(v, int) and not isinstance(v, bool) for v in items):
            packed = b"".join(_varint(v) for v in items)
            inner = _len_delimited(1, packed) if items else b""
            return body + _len_delimited(_INT64 + 1, inner)
        if all(isinstance(v, str) for v in items):
            inner = b"".join(_len_delimited(1, v.encode("utf-8")) for v in items)
            return body + _len_delimited(_STRING + 1, inner)
        if all(isinstance(v, float) for v in items):
            packed = struct.pack(f"<{len(items)}d", *items)
            return body + _len_delimited(_DOUBLE + 1, _len_delimited(1, packed))
        raise TraceError(f"attribute {name!r}: list mixes types or holds unsupported values")
    raise TraceError(f"attribute {name!r}: unsupported value type {type(value).__name__}")


_ATTR_CACHE: dict[tuple[str, type, Any], bytes] = {}


def _encode_attr(name: str, value: Any) -> bytes:
    """Encoded `attr` field (tag + length + AttributeProto), cached for hashable scalar values."""
    if not isinstance(value, (bool, int, str, float, bytes)):
        return _len_delimited(10, _encode_attr_value(name, value))
    key = (name, type(value), value)
    cached = _ATTR_CACHE.get(key)
    if cached is None:
        cached = _len_delimited(10, _encode_attr_value(name, value))
        if len(_ATTR_CACHE) < 100_000:
            _ATTR_CACHE[key] = cached
    return cached


def _encode_node(node: EtNode) -> bytes:
    parts: list[bytes] = []
    if node.id:
        parts.append(_T_ID + _varint(node.id))
    if node.name:
        raw = node.name.encode("utf-8")
        parts.append(_T_NAME + _varint(len(raw)) + raw)
    if node.type:
        parts.append(_T_TYPE + _varint(node.type))
    if node.ctrl_deps:
        packed = b"".join([_varint(d) for d in node.ctrl_deps])
        parts.append(_T_CTRL + _varint(len(packed)) + packed)
    if node.data_deps:
        packed = b"".join([_varint(d) for d in node.data_deps])
        parts.append(_T_DATA + _varint(len(packed)) + packed)
    if node.duration_micros:
        parts.append(_T_DUR + _varint(node.duration_micros))
    for name, value in node.attrs.items():
        parts.append(_encode_attr(name, value))
    return b"".join(parts)


def encode_trace(nodes: Iterable[EtNode], version: str = DEFAULT_VERSION) -> bytes:
    """Bytes of an ET file: the GlobalMetadata message, then one length-prefixed Node per node."""
    out = bytearray()
    meta = _len_delimited(1, version.encode("utf-8"))
    out += _varint(len(meta))
    out += meta
    for node in nodes:
        if node.id < 0 or node.type < 0 or node.duration_micros < 0:
            raise TraceError(f"node {node.id} ({node.name!r}): id, type and duration must be non-negative")
        body = _encode_node(node)
        out += _varint(len(body))
        out += body
    return bytes(out)


# --- decoding ----------------------------------------------------------------------------------------
class _Malformed(Exception):
    """Internal: a decoding problem, with the byte offset where it was found."""

    def __init__(self, message: str, offset: int):
        super().__init__(message)
        self.offset = offset


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    start = pos
    while True:
        if pos >= end:
            raise _Malformed("truncated varint", start)
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _MASK64, pos
        shift += 7
        if shift >= 70:
            raise _Malformed("varint longer than 10 bytes", start)


def _fields(buf: bytes, pos: int, end: int, what: str) -> list[tuple[int, int, Any, int]]:
    """(field_no, wire_type, value, offset) for each field of the message in buf[pos:end].

    value is an int for varint / fixed fields and a (start, stop) span for length-delimited ones.
    """
    out = []
    append = out.append
    while pos < end:
        offset = pos
        key = buf[pos]
        if key < 0x80:
            pos += 1
        else:
            key, pos = _read_varint(buf, pos, end)
        field_no, wire_type = key >> 3, key & 7
        if field_no == 0:
            raise _Malformed(f"{what}: field number 0", offset)
        if wire_type == _WT_VARINT or wire_type == _WT_LEN:
            if pos < end and buf[pos] < 0x80:
                value = buf[pos]
                pos += 1
            else:
                value, pos = _read_varint(buf, pos, end)
            if wire_type == _WT_VARINT:
                append((field_no, wire_type, value, offset))
            else:
                if pos + value > end:
                    raise _Malformed(f"{what}: field {field_no} length {value} runs past the end", offset)
                append((field_no, wire_type, (pos, pos + value), offset))
                pos += value
        elif wire_type == _WT_I64:
            if pos + 8 > end:
                raise _Malformed(f"{what}: truncated 64-bit field {field_no}", offset)
            append((field_no, wire_type, int.from_bytes(buf[pos:pos + 8], "little"), offset))
            pos += 8
        elif wire_type == _WT_I32:
            if pos + 4 > end:
                raise _Malformed(f"{what}: truncated 32-bit field {field_no}", offset)
            append((field_no, wire_type, int.from_bytes(buf[pos:pos + 4], "little"), offset))
            pos += 4
        else:
            raise _Malformed(f"{what}: field {field_no} has bad wire type {wire_type}", offset)
    return out


def _expect(what: str, field_no: int, wire_type: int, wanted: int, offset: int) -> None:
    if wire_type != wanted:
        raise _Malformed(
            f"{what}: field {field_no} has wire type {_WIRE_NAMES.get(wire_type, wire_type)}, "
            f"expected {_WIRE_NAMES[wanted]}", offset)


def _signed(value: int, bits: int) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def _zigzag(value: int) -> int:
    return (value >> 1) ^ -(value & 1)


def _scalar(kind: int, wire_type: int, value: int, buf: bytes, offset: int, what: str) -> Any:
    """Python value of one scalar of attribute variant `kind` (an odd field number)."""
    if kind == _DOUBLE:
        _expect(what, kind, wire_type, _WT_I64, offset)
        return struct.unpack("<d", value.to_bytes(8, "little"))[0]
    if kind == _FLOAT:
        _expect(what, kind, wire_type, _WT_I32, offset)
        return struct.unpack("<f", value.to_bytes(4, "little"))[0]
    if kind in (_INT32, _INT64, _UINT32, _UINT64, _SINT32, _SINT64, _BOOL):
        _expect(what, kind, wire_type, _WT_VARINT, offset)
        if kind == _INT32:
            return _signed(value, 32)
        if kind == _INT64:
            return _signed(value, 64)
        if kind == _UINT32:
            return value & 0xFFFFFFFF
        if kind in (_SINT32, _SINT64):
            return _zigzag(value)
        if kind == _BOOL:
            return value != 0
        return value
    if kind in (_FIXED32, _SFIXED32):
        _expect(what, kind, wire_type, _WT_I32, offset)
        return value if kind == _FIXED32 else _signed(value, 32)
    if kind in (_FIXED64, _SFIXED64):
        _expect(what, kind, wire_type, _WT_I64, offset)
        return value if kind == _FIXED64 else _signed(value, 64)
    _expect(what, kind, wire_type, _WT_LEN, offset)
    start, stop = value
    raw = bytes(buf[start:stop])
    if kind == _STRING:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Malformed(f"{what}: string is not valid UTF-8", offset) from None
    return raw  # _BYTES


def _packed_width(kind: int) -> int:
    """Bytes per element of a packed fixed-width list, or 0 for varint lists."""
    if kind in (_DOUBLE, _FIXED64, _SFIXED64):
        return 8
    if kind in (_FLOAT, _FIXED32, _SFIXED32):
        return 4
    return 0


def _decode_list(kind: int, buf: bytes, start: int, stop: int, what: str) -> list[Any]:
    """Values of a *List message (field 1 repeated) for scalar variant `kind`."""
    values: list[Any] = []
    for field_no, wire_type, value, offset in _fields(buf, start, stop, what):
        if field_no != 1:
            continue
        if wire_type == _WT_LEN and kind not in (_STRING, _BYTES):
            s, e = value
            width = _packed_width(kind)
            if width:
                if (e - s) % width:
                    raise _Malformed(f"{what}: packed list length {e - s} is not a multiple of {width}", offset)
                wt = _WT_I64 if width == 8 else _WT_I32
                for p in range(s, e, width):
                    values.append(_scalar(kind, wt, int.from_bytes(buf[p:p + width], "little"), buf, p, what))
            else:
                p = s
                while p < e:
                    item, p = _read_varint(buf, p, e)
                    values.append(_scalar(kind, _WT_VARINT, item, buf, p, what))
        else:
            values.append(_scalar(kind, wire_type, value, buf, offset, what))
    return values


def _decode_attr(buf: bytes, start: int, stop: int, what: str) -> tuple[str, Any]:
    name = ""
    value: Any = None
    for field_no, wire_type, raw, offset in _fields(buf, start, stop, what):
        if field_no == 1:
            _expect(what, 1, wire_type, _WT_LEN, offset)
            name = _scalar(_STRING, wire_type, raw, buf, offset, what)
        elif field_no == 2:
            _expect(what, 2, wire_type, _WT_LEN, offset)
        elif 3 <= field_no <= 32:
            label = f"{what} attribute {name!r}" if name else what
            if field_no % 2:
                value = _scalar(field_no, wire_type, raw, buf, offset, label)
            else:
                _expect(label, field_no, wire_type, _WT_LEN, offset)
                value = _decode_list(field_no - 1, buf, raw[0], raw[1], label)
    return name, value


def _decode_deps(wire_type: int, raw: Any, buf: bytes, out: list[int]) -> None:
    if wire_type == _WT_VARINT:
        out.append(raw)
        return
    p, stop = raw
    while p < stop:
        byte = buf[p]
        if byte < 0x80:
            out.append(byte)
            p += 1
        else:
            dep, p = _read_varint(buf, p, stop)
            out.append(dep)


def _decode_node(buf: bytes, start: int, stop: int, index: int,
                 attr_cache: dict[bytes, tuple[str, Any]]) -> EtNode:
    what = f"node message {index}"
    node_id = node_type = duration = 0
    name = ""
    data_deps: list[int] = []
    ctrl_deps: list[int] = []
    attrs: dict[str, Any] = {}
    for field_no, wire_type, raw, offset in _fields(buf, start, stop, what):
        if field_no == 10:
            if wire_type != _WT_LEN:
                _expect(what, 10, wire_type, _WT_LEN, offset)
            raw_attr = buf[raw[0]:raw[1]]
            decoded = attr_cache.get(raw_attr)
            if decoded is None:
                decoded = _decode_attr(buf, raw[0], raw[1], f"{what} (id {node_id})")
                if len(attr_cache) < 10_000:
                    attr_cache[raw_attr] = decoded
            attr_name, value = decoded
            if attr_name not in attrs:  # ASTRA-sim: the first attribute of a name wins
                attrs[attr_name] = list(value) if isinstance(value, list) else value
        elif field_no in (1, 3, 6, 7):
            if wire_type != _WT_VARINT:
                _expect(what, field_no, wire_type, _WT_VARINT, offset)
            if field_no == 1:
                node_id = raw
            elif field_no == 3:
                node_type = raw
            elif field_no == 7:
                duration = raw
        elif field_no == 2:
            if wire_type != _WT_LEN:
                _expect(what, 2, wire_type, _WT_LEN, offset)
            try:
                name = buf[raw[0]:raw[1]].decode("utf-8")
            except UnicodeDecodeError:
                raise _Malformed(f"{what}: name is not valid UTF-8", offset) from None
        elif field_no in (4, 5):
            if wire_type not in (_WT_VARINT, _WT_LEN):
                _expect(what, field_no, wire_type, _WT_LEN, offset)
            _decode_deps(wire_type, raw, buf, ctrl_deps if field_no == 4 else data_deps)
        elif field_no in (8, 9):
            if wire_type != _WT_LEN:
                _expect(what, field_no, wire_type, _WT_LEN, offset)
    return EtNode(node_id, name, node_type, data_deps, ctrl_deps, duration, attrs)


def _decode_metadata(buf: bytes, start: int, stop: int) -> None:
    for field_no, wire_type, _raw, offset in _fields(buf, start, stop, "GlobalMetadata"):
        if field_no in (1, 2) and wire_type != _WT_LEN:
            raise _Malformed(
                "the first message is not a GlobalMetadata (field "
                f"{field_no} has wire type {_WIRE_NAMES.get(wire_type, wire_type)}); "
                "ASTRA-sim would swallow the first node", offset)


def decode_trace(data: bytes, source: str = "<bytes>") -> list[EtNode]:
    """Nodes of an ET byte string (metadata first); TraceError names `source` on malformed input."""
    buf = bytes(data)
    if not buf:
        raise TraceError(f"{source}: empty ET file (no GlobalMetadata message)")
    if buf[:2] == b"\x1f\x8b":
        raise TraceError(f"{source}: gzip-compressed; ASTRA-sim reads plain (uncompressed) ET files only")
    nodes: list[EtNode] = []
    attr_cache: dict[bytes, tuple[str, Any]] = {}
    pos, end, index = 0, len(buf), -1
    try:
        while pos < end:
            offset = pos
            length, pos = _read_varint(buf, pos, end)
            if pos - offset > 5:
                raise _Malformed("message length prefix longer than 5 bytes", offset)
            if pos + length > end:
                raise _Malformed(f"message length {length} runs past the end of the file", offset)
            if index < 0:
                _decode_metadata(buf, pos, pos + length)
            else:
                nodes.append(_decode_node(buf, pos, pos + length, index, attr_cache))
            pos += length
            index += 1
    except _Malformed as problem:
        raise TraceError(f"{source}: malformed ET at byte {problem.offset}: {problem}") from None
    return nodes


def write_trace(path: str | Path, nodes: Iterable[EtNode], version: str = DEFAULT_VERSION) -> Path:
    """Write one rank's ET file; returns its path."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(encode_trace(nodes, version))
    except OSError as exc:
        raise TraceError(f"{target}: cannot write ET file: {exc.strerror or exc}") from None
    return target


def read_trace(path: str | Path) -> list[EtNode]:
    """Nodes of one ET file; TraceError if it is missing, unreadable or malformed."""
    source = Path(path)
    try:
        data = source.read_bytes()
    except FileNotFoundError:
        raise TraceError(f"{source}: ET file does not exist") from None
    except OSError as exc:
        raise TraceError(f"{source}: cannot read ET file: {exc.strerror or exc}") from None
    return decode_trace(data, str(source))


def trace_path(prefix: str | Path, rank: int) -> Path:
    """The file ASTRA-sim opens for `rank`: `<prefix>.<rank>.et`."""
    return Path(f"{prefix}.{rank}.et")


def trace_prefix(path: str | Path) -> Path:
    """``path`` as a trace prefix: itself, or for a folder holding one set of traces (``<name>.0.et``, …,
    as ``simulate --out`` writes them) that set's prefix. TraceError for a folder with none or several."""
    folder = Path(path)
    if not folder.is_dir():
        return folder
    names = sorted(p.name[:-len(".0.et")] for p in folder.glob("*.0.et"))
    if len(names) != 1:
        found = ", ".join(names[:5]) + (" …" if len(names) > 5 else "")
        raise TraceError(f"{folder}: a folder of traces must hold one set (<name>.0.et, <name>.1.et, …); it holds "
                         + (f"{len(names)}: {found} (give the prefix {folder / names[0]})" if names else "none"))
    return folder / names[0]


def read_traces(prefix: str | Path, n_ranks: int | None = None) -> list[list[EtNode]]:
    """Per-rank nodes from `<prefix>.<r>.et`, r = 0..n_ranks-1 (all consecutive ranks when None)."""
    if n_ranks is None:
        count = 0
        while trace_path(prefix, count).is_file():
            count += 1
        if count == 0:
            raise TraceError(f"{trace_path(prefix, 0)}: ET file does not exist (no ranks found for prefix {prefix})")
        n_ranks = count
    if n_ranks < 1:
        raise TraceError(f"{prefix}: n_ranks must be at least 1, got {n_ranks}")
    return [read_trace(trace_path(prefix, rank)) for rank in range(n_ranks)]


def write_traces(prefix: str | Path, traces: Sequence[Iterable[EtNode]],
                 version: str = DEFAULT_VERSION) -> list[Path]:
    """Write `<prefix>.<r>.et` for every rank r of `traces`; returns the paths."""
    return [write_trace(trace_path(prefix, rank), nodes, version) for rank, nodes in enumerate(traces)]
