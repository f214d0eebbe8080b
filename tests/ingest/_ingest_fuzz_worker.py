"""Fuzz worker: ingests seeded mutations of the shared StableHLO programs, one case at a time.

Run as ``python _ingest_fuzz_worker.py SHARED_MLIR_DIR SEED N_CASES START``. For every case from START on it
prints ``S <i>`` before parsing and ``R <i> <outcome> <detail>`` after (outcome: ``ok``, ``err`` for a
clean IngestError, ``bad`` for anything else), flushing each line, so a supervising process can tell
which case crashed the interpreter or hung. ``cases()`` is deterministic for a given seed.
"""
from __future__ import annotations

import faulthandler
import json
import random
import re
import sys
from pathlib import Path

SMALL = ["convolution.mlir", "custom_call_topk.mlir", "jax_example.mlir", "test_dependency_graph.mlir",
         "test_no_comm_graph.mlir", "test_split_replica_groups.mlir"]
LARGE = "resnet_50_inference_step_4_devices_1024_batch.mlir"

JUNK = ["{", "}", "(", ")", "<", ">", "[", "]", "%0", "%999", "@main", "func.func @f() {", "return",
        "tensor<?x4xf32>", "tensor<*xf32>", "tensor<4x4xf32>", "stablehlo.add", "\"stablehlo.while\"",
        "dense<", "#stablehlo.", "#sdy<axis_ref", "sdy.mesh @mesh = <[\"x\"=4]>", "\\", "\"", "'", "//",
        "\n", ":", "->", "^bb0:", "0x7FFFFFFF", "-1", "99999999999999999999", "loc(", "\u00e9", "\u2603",
        "func.call @main() : () -> ()", "stablehlo.return", "mhlo.num_replicas = 0 : i32", "\\E3", "\\C3\\A9",
        '"\\FF"', "\\"]
NUMBERS = ["0", "1", "-1", "2", "3", "7", "64", "1000", "65536", "2147483647", "-2147483648",
           "9223372036854775807", "18446744073709551616", "1.5", "1e308", "nan"]
_NUM = re.compile(r"(?<![\w.%#@])\d+(?![\w])")
_OPNAME = re.compile(r"\b(?:stablehlo|mhlo|func|sdy)\.[a-z_]+\b")


def _mutate_text(rng: random.Random, text: str) -> tuple[str, str]:
    lines = text.split("\n")
    kind = rng.choice(["delete", "duplicate", "swap", "flip", "truncate", "junk", "number", "number",
                       "opname", "escape", "multi"])
    if kind == "multi":
        notes = []
        for _ in range(rng.randint(2, 4)):
            text, note = _mutate_text(rng, text)
            notes.append(note)
        return text, "+".join(notes)
    if kind == "delete" and len(lines) > 1:
        i = rng.randrange(len(lines))
        return "\n".join(lines[:i] + lines[i + 1:]), f"delete line {i + 1}"
    if kind == "duplicate":
        i = rng.randrange(len(lines))
        return "\n".join(lines[:i + 1] + lines[i:]), f"duplicate line {i + 1}"
    if kind == "swap" and len(lines) > 1:
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
        return "\n".join(lines), f"swap lines {i + 1},{j + 1}"
    if kind == "number":
        nums = list(_NUM.finditer(text))
        if nums:
            m = rng.choice(nums)
            new = rng.choice(NUMBERS)
            return text[:m.start()] + new + text[m.end():], f"number@{m.start()}->{new}"
    if kind == "opname":
        names = list(_OPNAME.finditer(text))
        if names:
            m = rng.choice(names)
            new = rng.choice(sorted({n.group(0) for n in names}))
            return text[:m.start()] + new + text[m.end():], f"opname@{m.start()}->{new}"
    if kind == "escape":                     # a \XX escape inside a string literal or symbol name
        quotes = [i for i, c in enumerate(text) if c == '"']
        if quotes:
            pos = rng.choice(quotes) + 1
            esc = "\\" + "".join(rng.choice("0123456789ABCDEF") for _ in range(2))
            return text[:pos] + esc + text[pos:], f"escape@{pos}:{esc}"
    if kind == "truncate":
        cut = rng.randrange(len(text))
        return text[:cut], f"truncate@{cut}"
    if kind == "junk":
        pos = rng.randrange(len(text) + 1)
        junk = rng.choice(JUNK) * rng.choice([1, 1, 1, 3, 50])
        return text[:pos] + junk + text[pos:], f"junk@{pos}:{junk[:20]!r}"
    pos = rng.randrange(len(text))          # flip (also the fallback of the kinds above)
    ch = chr(rng.randrange(256))
    return text[:pos] + ch + text[pos + 1:], f"flip@{pos}->{ord(ch)}"


def _mutate_bytes(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    b = bytearray(data)
    kind = rng.choice(["flip", "flip", "truncate", "delete", "insert"])
    if kind == "truncate":
        cut = rng.randrange(len(b))
        return bytes(b[:cut]), f"bc-truncate@{cut}"
    if kind == "delete":
        i = rng.randrange(len(b))
        n = rng.randint(1, 16)
        return bytes(b[:i] + b[i + n:]), f"bc-delete@{i}+{n}"
    if kind == "insert":
        i = rng.randrange(len(b) + 1)
        junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        return bytes(b[:i] + junk + b[i:]), f"bc-insert@{i}+{len(junk)}"
    notes = []
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(4, len(b))        # keep the magic so the bytecode reader is exercised
        b[i] = rng.randrange(256)
        notes.append(str(i))
    return bytes(b), "bc-flip@" + ",".join(notes)


def _bytecode(text: str) -> bytes:
    import io

    from jax.extend.mlir import ir
    from jax.interpreters import mlir as jmlir

    with jmlir.make_ir_context():
        module = ir.Module.parse(text)
        buf = io.BytesIO()
        module.operation.write_bytecode(buf)
        return buf.getvalue()


def cases(shared_mlir: Path, seed: int, n: int) -> list[tuple[str, str, str | bytes]]:
    """``n`` mutated programs as (source file, mutation, data): ~5% ResNet text, ~15% bytecode."""
    rng = random.Random(seed)
    small = {name: (shared_mlir / name).read_text() for name in SMALL if (shared_mlir / name).exists()}
    large = (shared_mlir / LARGE).read_text() if (shared_mlir / LARGE).exists() else None
    bytecode = {name: _bytecode(text) for name, text in small.items()}
    out: list[tuple[str, str, str | bytes]] = []
    for _ in range(n):
        r = rng.random()
        if r < 0.05 and large is not None:
            data, note = _mutate_text(rng, large)
            out.append((LARGE, note, data))
        elif r < 0.20:
            name = rng.choice(sorted(bytecode))
            data, note = _mutate_bytes(rng, bytecode[name])
            out.append((name + "bc", note, data))
        else:
            name = rng.choice(sorted(small))
            data, note = _mutate_text(rng, small[name])
            out.append((name, note, data))
    return out


def main() -> None:
    faulthandler.enable()
    shared_mlir, seed, n, start = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from hespas_ml.ingest.errors import IngestError
    from hespas_ml.ingest.stablehlo import parse_module

    all_cases = cases(shared_mlir, seed, n)
    print("READY", flush=True)
    for i in range(start, n):
        name, note, data = all_cases[i]
        source = f"fuzz{i}-{name}"
        print(f"S {i}", flush=True)
        try:
            parse_module(data, source=source)
            outcome, detail = "ok", ""
        except IngestError as exc:
            text = str(exc)
            clean = "\n" not in text and text.startswith(source + ": ") and "internal error" not in text
            outcome, detail = ("err", text[:200]) if clean else ("bad", "unclean IngestError: " + text[:300])
        except BaseException as exc:  # noqa: BLE001 - the point is to see everything
            outcome, detail = "bad", f"{type(exc).__name__}: {str(exc)[:300]}"
        print(f"R {i} {outcome} " + json.dumps({"src": name, "mutation": note, "detail": detail}), flush=True)


if __name__ == "__main__":
    main()
