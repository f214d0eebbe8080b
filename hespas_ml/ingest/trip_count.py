"""Loop trip counts: the scalar induction logic of a ``stablehlo.while`` run symbolically.

While walking, :class:`TripCounter` remembers statically known scalar results (constants and simple folds
of them). For a loop, its condition and body are compiled to straight-line scalar code
(:class:`_ScalarProgram`) and run from the known initial values; after :data:`EXACT_TRIP_STEPS`
iterations affine counters are extrapolated (up to :data:`MAX_DERIVED_TRIPS`).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .attributes import decode
from .bindings import TERMINATORS, mlir, text_of

MAX_DERIVED_TRIPS = 10**12       # larger derived trip counts are treated as not derivable
EXACT_TRIP_STEPS = 2_000         # loop iterations simulated one by one before extrapolating


class TripCounter:
    """Known scalar values by op id, and trip counts of loops whose control they decide."""

    def __init__(self, funcs: dict[str, Any]):
        self.funcs = funcs                        # function name -> func.func op (for calls in loop bodies)
        self.known_scalars: dict[int, Any] = {}   # op id -> statically known scalar result value

    def fold(self, oid: int, name: str, operands: list[int], attrs: dict, rtypes) -> None:
        """Remember statically known scalar results (constants and simple folds) for trip counts."""
        if len(rtypes) != 1 or rtypes[0].shape != ():
            return
        if name == "stablehlo.constant":
            v = attrs.get("value")
            if isinstance(v, (int, bool, float)):
                self.known_scalars[oid] = v
            return
        vals = [self.known_scalars.get(p) for p in operands]
        if not operands or any(v is None for v in vals):
            return
        fn = _SCALAR_FOLDS.get(name)
        if fn is not None:
            try:
                extra = {"comparison_direction": attrs.get("comparison_direction", ""), "dtype": rtypes[0].dtype}
                self.known_scalars[oid] = _typed(fn(vals, extra), rtypes[0].dtype)
            except Exception:
                pass

    def trip_count(self, op, init_ids: list[int]) -> int | None:
        """Run the loop's scalar induction logic symbolically; extrapolate affine counters past
        :data:`EXACT_TRIP_STEPS` iterations (up to :data:`MAX_DERIVED_TRIPS`)."""
        init = [self.known_scalars.get(i) if i >= 0 else None for i in init_ids]
        if all(v is None for v in init):
            return None
        try:
            cond = _ScalarProgram(self.funcs, op.regions[0].blocks[0])
            body = _ScalarProgram(self.funcs, op.regions[1].blocks[0])
        except Exception:
            return None
        state = init
        for trips in range(EXACT_TRIP_STEPS):
            c = cond.run(state)
            if not c or c[0] is None:
                return None
            if not c[0]:
                return trips
            nxt = body.run(state)
            if len(nxt) != len(state):
                return None
            state = nxt
        more = _extrapolate(cond, body, state)
        if more is None or EXACT_TRIP_STEPS + more > MAX_DERIVED_TRIPS:
            return None
        return EXACT_TRIP_STEPS + more


def _extrapolate(cond: _ScalarProgram, body: _ScalarProgram, state: list) -> int | None:
    """Trips left from ``state`` when every known loop value moves by a constant integer step.

    Values that are not affine become unknown; if the condition needs them, nothing is derived.
    """
    s1 = body.run(state)
    s2 = body.run(s1) if len(s1) == len(state) else []
    if len(s2) != len(state):
        return None
    base, step = [], []
    for a, b, c in zip(state, s1, s2):
        if isinstance(a, int) and not isinstance(a, bool) and isinstance(b, int) and isinstance(c, int) \
                and b - a == c - b:
            base.append(a)
            step.append(b - a)
        elif a is not None and a == b == c:
            base.append(a)
            step.append(0)
        else:
            base.append(None)
            step.append(0)

    def running(t: int) -> bool | None:
        out = cond.run([None if v is None else v + t * d if d else v for v, d in zip(base, step)])
        return None if not out or out[0] is None else bool(out[0])

    first = running(0)
    if first is None:
        return None
    if not first:
        return 0
    lo, hi = 0, 1                 # running(lo) is True; find hi with running(hi) False
    while True:
        r = running(hi)
        if r is None:
            return None
        if not r:
            break
        lo, hi = hi, hi * 2
        if hi > MAX_DERIVED_TRIPS:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        r = running(mid)
        if r is None:
            return None
        lo, hi = (mid, hi) if r else (lo, mid)
    return hi


def _cmp(direction: str) -> Callable[[Any, Any], bool]:
    return {"LT": lambda a, b: a < b, "LE": lambda a, b: a <= b, "GT": lambda a, b: a > b,
            "GE": lambda a, b: a >= b, "EQ": lambda a, b: a == b, "NE": lambda a, b: a != b}[direction]


def _int_div(a, b):
    if isinstance(a, int) and isinstance(b, int):
        q = abs(a) // abs(b)
        return q if (a >= 0) == (b >= 0) else -q   # rounds towards zero, as HLO does
    return a / b


def _int_rem(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a - _int_div(a, b) * b
    return float(np.fmod(a, b))


def _typed(value: Any, dtype: str) -> Any:
    """A folded scalar converted to the result's element type (Python bool / int / float)."""
    if dtype == "i1":
        return bool(value)
    if dtype.startswith(("i", "si", "ui")):
        return int(value)
    if dtype.startswith(("f", "bf")):
        return float(value)
    return value


_SCALAR_FOLDS: dict[str, Callable[[list, dict], Any]] = {
    "stablehlo.add": lambda v, a: v[0] + v[1],
    "stablehlo.subtract": lambda v, a: v[0] - v[1],
    "stablehlo.multiply": lambda v, a: v[0] * v[1],
    "stablehlo.maximum": lambda v, a: max(v[0], v[1]),
    "stablehlo.minimum": lambda v, a: min(v[0], v[1]),
    "stablehlo.negate": lambda v, a: -v[0],
    "stablehlo.abs": lambda v, a: abs(v[0]),
    "stablehlo.convert": lambda v, a: v[0],
    "mhlo.copy": lambda v, a: v[0],
    "stablehlo.and": lambda v, a: v[0] and v[1] if isinstance(v[0], bool) else v[0] & v[1],
    "stablehlo.or": lambda v, a: v[0] or v[1] if isinstance(v[0], bool) else v[0] | v[1],
    "stablehlo.not": lambda v, a: (not v[0]) if isinstance(v[0], bool) else ~v[0],
    "stablehlo.select": lambda v, a: v[1] if v[0] else v[2],
    "stablehlo.clamp": lambda v, a: min(max(v[1], v[0]), v[2]),
    "stablehlo.compare": lambda v, a: _cmp(a["comparison_direction"])(v[0], v[1]),
    "stablehlo.divide": lambda v, a: _int_div(v[0], v[1]),
    "stablehlo.remainder": lambda v, a: _int_rem(v[0], v[1]),
}


class _ScalarProgram:
    """A loop region compiled to straight-line scalar code: non-scalar values evaluate to ``None``."""

    def __init__(self, funcs: dict[str, Any], block):
        self.steps: list[tuple] = []
        self.nargs = len(block.arguments)
        slots: dict = {a: i for i, a in enumerate(block.arguments)}
        self.nslots = self.nargs
        self.funcs = funcs
        self.outputs = self._compile(block, slots, 0)

    def _slot(self) -> int:
        self.nslots += 1
        return self.nslots - 1

    def _compile(self, block, slots: dict, depth: int) -> list[int | None]:
        if depth > 16:
            raise _NotScalar()
        _, ir, _ = mlir()
        outs: list[int | None] = []
        for op in block.operations:
            op = op.operation
            name = op.name
            ins = [slots.get(v) for v in op.operands]
            if name in TERMINATORS:
                outs = ins
                continue
            if name in ("mhlo.fusion", "func.call"):
                if name == "func.call":
                    f = self.funcs.get(text_of(op.attributes["callee"])) if "callee" in op.attributes else None
                    if f is None or not f.regions or not f.regions[0].blocks:
                        continue
                    inner = f.regions[0].blocks[0]
                elif len(op.regions) == 1 and len(op.regions[0].blocks) == 1:
                    inner = op.regions[0].blocks[0]
                else:
                    continue
                sub = {a: s for a, s in zip(inner.arguments, ins) if s is not None}
                res = self._compile(inner, sub, depth + 1)
                for r, s in zip(op.results, res):
                    if s is not None:
                        slots[r] = s
                continue
            if len(op.results) != 1:
                continue
            ty = op.results[0].type
            if not isinstance(ty, ir.RankedTensorType) or list(ty.shape) != []:
                continue
            dtype = str(ty.element_type)
            if name == "stablehlo.constant":
                v = decode("value", op.attributes["value"], name)
                if not isinstance(v, (bool, int, float)):
                    continue
                s = self._slot()
                self.steps.append((s, None, (), v))
                slots[op.results[0]] = s
                continue
            fn = _SCALAR_FOLDS.get(name)
            if fn is None or any(i is None for i in ins):
                continue
            extra = {"dtype": dtype, "comparison_direction": ""}
            if name == "stablehlo.compare":
                extra["comparison_direction"] = decode("comparison_direction", op.attributes["comparison_direction"],
                                                      name)
            s = self._slot()
            self.steps.append((s, fn, tuple(ins), extra))
            slots[op.results[0]] = s
        return outs

    def run(self, args: list) -> list:
        vals: list = [None] * self.nslots
        k = min(len(args), self.nargs)
        vals[:k] = args[:k]
        for s, fn, ins, extra in self.steps:
            if fn is None:
                vals[s] = extra
                continue
            xs = [vals[i] for i in ins]
            if any(x is None for x in xs):
                vals[s] = None
                continue
            try:
                vals[s] = _typed(fn(xs, extra), extra["dtype"])
            except Exception:
                vals[s] = None
        return [vals[i] if i is not None else None for i in self.outputs]


class _NotScalar(Exception):
    pass
