"""Chakra ET encoder/decoder: round trips, the recorded vectors, every attribute variant, bad input."""
from __future__ import annotations

import gzip
import struct

import pytest
from vector_cases import load_vector, vector_names

from hespas_ml.replay import chakra as et
from hespas_ml.replay.errors import TraceError

NODE_TYPES = {name: value for value, name in et.NODE_TYPE_NAMES.items()}
COLLECTIVES = {name: value for value, name in et.COLLECTIVE_NAMES.items()}


# --- a tiny independent protobuf writer, for inputs our encoder never produces -----------------------
def varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, wire: int, payload: bytes) -> bytes:
    key = varint(number << 3 | wire)
    return key + (varint(len(payload)) + payload if wire == 2 else payload)


def framed(*messages: bytes) -> bytes:
    return b"".join(varint(len(m)) + m for m in messages)


METADATA = field(1, 2, b"0.0.4")


def node_with_attr(attr_body: bytes) -> bytes:
    return field(1, 0, varint(7)) + field(2, 2, b"n") + field(3, 0, varint(4)) + field(10, 2, attr_body)


def decoded_attr(value_field: bytes) -> object:
    nodes = et.decode_trace(framed(METADATA, node_with_attr(field(1, 2, b"x") + value_field)))
    return nodes[0].attrs["x"]


# --- round trips ----------------------------------------------------------------------------------------
def test_every_field_and_attribute_kind_round_trips() -> None:
    nodes = [
        et.EtNode(1, "comp", et.COMP_NODE, [], [], 12),
        et.EtNode(2**40, "all_reduce", et.COMM_COLL_NODE, [1], [1, 5], 0, {
            "comm_type": et.ALL_REDUCE, "comm_size": 2**33 + 7, "pg_name": "3", "involved_dim": [True, False, True],
            "flag": False, "neg": -5, "ratio": 0.125, "blob": b"\x00\xff", "ids": [0, 300, 2**62],
            "names": ["a", "bé"], "floats": [1.5, -2.25]}),
        et.EtNode(5, "", et.COMM_SEND_NODE, [], [2**40], 3, {"comm_dst": 1, "comm_tag": 0, "comm_size": 1}),
        et.EtNode(0, "zero-id", et.INVALID_NODE, [], []),
    ]
    data = et.encode_trace(nodes, version="banana")
    assert et.decode_trace(data) == nodes


def test_files_round_trip_per_rank(tmp_path) -> None:
    traces = [[et.EtNode(1, f"r{r}", et.COMP_NODE, [], [], r + 1)] for r in range(3)]
    paths = et.write_traces(tmp_path / "et" / "dev", traces)
    assert [p.name for p in paths] == ["dev.0.et", "dev.1.et", "dev.2.et"]
    assert et.read_traces(tmp_path / "et" / "dev") == traces
    assert et.read_traces(tmp_path / "et" / "dev", 2) == traces[:2]


def test_read_traces_names_the_first_missing_rank(tmp_path) -> None:
    et.write_traces(tmp_path / "dev", [[et.EtNode(1, "a", et.COMP_NODE, [], [])]] * 2)
    with pytest.raises(TraceError, match=r"dev\.2\.et: ET file does not exist"):
        et.read_traces(tmp_path / "dev", 3)
    with pytest.raises(TraceError, match=r"nothing\.0\.et"):
        et.read_traces(tmp_path / "nothing")


def test_a_folder_of_one_set_of_traces_names_its_prefix(tmp_path) -> None:
    assert et.trace_prefix(tmp_path / "et" / "dev") == tmp_path / "et" / "dev"        # a prefix as it is
    et.write_traces(tmp_path / "et" / "dev", [[et.EtNode(1, "a", et.COMP_NODE, [], [])]] * 2)
    assert et.trace_prefix(tmp_path / "et") == tmp_path / "et" / "dev"
    with pytest.raises(TraceError, match=r"empty: a folder of traces must hold one set .*it holds none"):
        (tmp_path / "empty").mkdir()
        et.trace_prefix(tmp_path / "empty")
    et.write_traces(tmp_path / "et" / "other", [[et.EtNode(1, "a", et.COMP_NODE, [], [])]])
    with pytest.raises(TraceError, match=r"it holds 2: dev, other \(give the prefix .*dev\)"):
        et.trace_prefix(tmp_path / "et")


# --- the recorded vectors -------------------------------------------------------------------------------
def expected_node(entry: dict) -> et.EtNode:
    attrs = {}
    for key in ("comm_type", "comm_size", "pg_name", "involved_dim", "comm_src", "comm_dst", "comm_tag"):
        if key in entry:
            value = entry[key]
            attrs[key] = COLLECTIVES[value] if key == "comm_type" else value
    return et.EtNode(entry["id"], entry["name"], NODE_TYPES[entry["type"]], entry["data_deps"], entry["ctrl_deps"],
                     entry.get("duration_micros", 0), attrs)


@pytest.mark.parametrize("name", vector_names())
def test_vector_files_decode_to_their_scenario_and_reencode_identically(name: str) -> None:
    vector = load_vector(name)
    for rank, nodes in enumerate(vector.traces):
        want = [expected_node(e) for e in vector.scenario["nodes_per_rank"][str(rank)]]
        assert nodes == want
        raw = (vector.folder / "et" / f"dev.{rank}.et").read_bytes()
        assert et.encode_trace(nodes) == raw


# --- every attribute variant decodes like ASTRA-sim's feeder reads it -------------------------------------
@pytest.mark.parametrize("value_field, expected", [
    (field(7, 0, varint(-3)), -3),                          # int32 (sign-extended to 10 bytes)
    (field(9, 0, varint(-(2**40))), -(2**40)),              # int64
    (field(11, 0, varint(4_000_000_000)), 4_000_000_000),   # uint32
    (field(13, 0, varint(2**63 + 1)), 2**63 + 1),           # uint64
    (field(15, 0, varint(5)), -3),                          # sint32, zigzag(5) = -3
    (field(17, 0, varint(8)), 4),                           # sint64, zigzag(8) = 4
    (field(19, 5, struct.pack("<I", 70000)), 70000),        # fixed32
    (field(21, 1, struct.pack("<Q", 2**50)), 2**50),        # fixed64
    (field(23, 5, struct.pack("<i", -9)), -9),              # sfixed32
    (field(25, 1, struct.pack("<q", -(2**45))), -(2**45)),  # sfixed64
    (field(27, 0, varint(1)), True),                        # bool
    (field(3, 1, struct.pack("<d", 2.5)), 2.5),             # double
    (field(5, 5, struct.pack("<f", 0.75)), 0.75),           # float
    (field(29, 2, "µs".encode()), "µs"),                   # string
    (field(31, 2, b"\x01\x02"), b"\x01\x02"),               # bytes
])
def test_scalar_attribute_variants(value_field: bytes, expected: object) -> None:
    value = decoded_attr(value_field)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("value_field, expected", [
    (field(28, 2, field(1, 2, b"\x01\x00\x01")), [True, False, True]),                  # packed bool_list
    (field(10, 2, field(1, 2, varint(1) + varint(-2))), [1, -2]),                       # packed int64_list
    (field(14, 2, field(1, 0, varint(3)) + field(1, 0, varint(4))), [3, 4]),             # unpacked uint64_list
    (field(18, 2, field(1, 2, varint(3))), [-2]),                                       # sint64_list
    (field(20, 2, field(1, 2, struct.pack("<2I", 1, 2))), [1, 2]),                      # fixed32_list
    (field(4, 2, field(1, 2, struct.pack("<2d", 0.5, 4.0))), [0.5, 4.0]),               # double_list
    (field(30, 2, field(1, 2, b"ab") + field(1, 2, b"c")), ["ab", "c"]),                # string_list
])
def test_list_attribute_variants(value_field: bytes, expected: list) -> None:
    assert decoded_attr(value_field) == expected


def test_unpacked_dependencies_and_first_attribute_of_a_name_win() -> None:
    body = (field(1, 0, varint(9)) + field(5, 0, varint(3)) + field(5, 0, varint(4)) + field(4, 0, varint(1))
            + field(10, 2, field(1, 2, b"comm_size") + field(9, 0, varint(10)))
            + field(10, 2, field(1, 2, b"comm_size") + field(9, 0, varint(20)))
            + field(6, 0, varint(123)) + field(8, 2, field(1, 2, b"ignored")))
    node = et.decode_trace(framed(METADATA, body))[0]
    assert (node.id, node.data_deps, node.ctrl_deps, node.attrs) == (9, [3, 4], [1], {"comm_size": 10})


# --- malformed input: one-line TraceError naming the file and the problem --------------------------------
GOOD = et.encode_trace([et.EtNode(1, "comp", et.COMP_NODE, [], [], 5)])


@pytest.mark.parametrize("data, problem", [
    (b"", "empty ET file"),
    (gzip.compress(GOOD), "gzip"),
    (GOOD[:-1], "runs past the end"),
    (GOOD + b"\x80", "truncated varint"),
    (framed(METADATA, field(1, 0, b"")[:1] + b"\x80"), "truncated varint"),
    (framed(METADATA, varint(1 << 3 | 3)), "bad wire type 3"),
    (framed(METADATA, field(2, 0, varint(5))), "field 2 has wire type varint, expected length-delimited"),
    (framed(field(1, 0, varint(1)), field(1, 0, varint(2))), "not a GlobalMetadata"),
    (framed(METADATA, node_with_attr(field(1, 2, b"x") + field(29, 2, b"\xff\xfe"))), "not valid UTF-8"),
    (framed(METADATA, node_with_attr(field(1, 2, b"x") + field(29, 0, varint(3)))),
     "field 29 has wire type varint, expected length-delimited"),
    (framed(METADATA, node_with_attr(field(1, 2, b"x") + field(3, 0, varint(3)))),
     "field 3 has wire type varint, expected 64-bit"),
])
def test_malformed_bytes_raise_trace_error(tmp_path, data: bytes, problem: str) -> None:
    path = tmp_path / "bad.0.et"
    path.write_bytes(data)
    with pytest.raises(TraceError) as info:
        et.read_trace(path)
    message = str(info.value)
    assert str(path) in message and problem in message and "\n" not in message


def test_missing_file_raises_trace_error(tmp_path) -> None:
    with pytest.raises(TraceError, match=r"missing\.0\.et: ET file does not exist"):
        et.read_trace(tmp_path / "missing.0.et")


def test_unencodable_attribute_is_a_trace_error() -> None:
    with pytest.raises(TraceError, match="attribute 'x'"):
        et.encode_trace([et.EtNode(1, "a", et.COMP_NODE, [], [], 0, {"x": {"no": "dicts"}})])
    with pytest.raises(TraceError, match="mixes types"):
        et.encode_trace([et.EtNode(1, "a", et.COMP_NODE, [], [], 0, {"x": [1, "a"]})])
