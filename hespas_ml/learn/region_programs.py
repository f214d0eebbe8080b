"""Typed op DAGs as StableHLO modules: the shapes and element types of a generated region graph, decided
by construction, written as a module the normal pipeline ingests, splits and labels.

A :class:`TypedDag` is what a generator samples: nodes in topological order, each an op kind of
:data:`OP_KINDS` with one source per operand slot (an earlier node, or ``None`` for a fresh parameter of the
module). :func:`realise` walks it once and gives every value a tensor type:

* a node's *primary* operand decides its shape (slot 0; for an op whose operands share one type, the first
  slot an earlier node feeds); a node whose primary operand is a parameter takes the graph's base tensor
  (drawn from the shapes of real regions);
* every other slot needs a type the op dictates (the same tensor for an element-wise op, ``[K, N]`` for a
  product's right side, ``i1`` for a predicate); an earlier node of another type there is *rewired*: the
  slot becomes a parameter of the type it needs (counted in :attr:`Realised.rewired`), so every module is
  valid by construction;
* every node no other node uses is a result of ``@main``.

:func:`module_text` writes the module in MLIR's generic op form, which the MLIR verifier then checks when
the module is parsed (:func:`check_module`: parse, verify, ingest, split, one region's record).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["OP_KINDS", "ARITY", "TypedDag", "Realised", "realise", "module_text", "program_text", "check_module",
           "InvalidProgram"]

UNARY = ("exponential", "rsqrt", "negate", "sqrt", "tanh", "log", "abs", "sine", "cosine")
BINARY = ("add", "subtract", "multiply", "divide", "maximum", "minimum", "power")
SHAPED = ("broadcast_in_dim", "reshape", "transpose", "reduce", "slice", "pad", "convert")
#: The op kinds a generated graph may hold (the region graphs' kinds outside it are left out of training).
OP_KINDS: tuple[str, ...] = (UNARY + BINARY + SHAPED
                             + ("compare", "select", "and", "dot_general", "convolution", "concatenate",
                                "constant", "iota"))
#: Operand slots per kind.
ARITY: dict[str, int] = {**{k: 1 for k in UNARY + SHAPED}, **{k: 2 for k in BINARY},
                         "compare": 2, "select": 3, "and": 2, "dot_general": 2, "convolution": 2,
                         "concatenate": 2, "constant": 0, "iota": 0}
FLOATS = ("f32", "bf16")
GEMM_WIDTHS = (64, 128, 256, 512, 1024, 4096)


class InvalidProgram(ValueError):
    """A generated module that MLIR or the pipeline refuses (the message says which step and why)."""


@dataclass
class TypedDag:
    """Nodes in topological order: ``kinds[i]`` an op of :data:`OP_KINDS`; ``sources[i][j]`` the earlier
    node feeding operand slot ``j`` (``None``: a parameter); ``layers[i]`` the node's topological layer."""

    kinds: list[str]
    sources: list[list[int | None]]
    layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.kinds) != len(self.sources):
            raise ValueError("a typed DAG needs one source list per node")
        for i, (kind, slots) in enumerate(zip(self.kinds, self.sources)):
            if kind not in ARITY:
                raise ValueError(f"node {i}: unknown op kind {kind!r}")
            if len(slots) != ARITY[kind]:
                raise ValueError(f"node {i}: {kind} takes {ARITY[kind]} operands, got {len(slots)}")
            if any(s is not None and not 0 <= s < i for s in slots):
                raise ValueError(f"node {i}: an operand must come from an earlier node")
        if not self.layers:
            self.layers = dag_layers(self.sources)


def dag_layers(sources: list[list[int | None]]) -> list[int]:
    """Each node's topological layer: 0 with no producer among the nodes, else one more than its latest."""
    layers: list[int] = []
    for slots in sources:
        inner = [layers[s] for s in slots if s is not None]
        layers.append(1 + max(inner) if inner else 0)
    return layers


Tensor = tuple[tuple[int, ...], str]


@dataclass
class Realised:
    """A typed DAG with tensor types: ``params`` (the module's parameters), each node's ``operands`` (a
    parameter ``("p", k)`` or a node ``("v", i)``), result ``types``, op ``attrs``, and the ``results``."""

    dag: TypedDag
    params: list[Tensor]
    operands: list[list[tuple[str, int]]]
    types: list[Tensor]
    attrs: list[dict[str, Any]]
    results: list[int]
    rewired: int


def _elems(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape)) if shape else 1


def _base(rng: np.random.Generator, shapes: list[tuple[int, ...]] | None) -> tuple[int, ...]:
    if shapes:
        return tuple(int(d) for d in shapes[int(rng.integers(len(shapes)))])
    return (8, 256)


def realise(dag: TypedDag, rng: np.random.Generator, shapes: list[tuple[int, ...]] | None = None,
            dtype: str = "f32", max_elems: int = 1 << 26) -> Realised:
    """Tensor types for ``dag`` (see the module docstring): ``shapes`` are the base shapes drawn from (the
    operand shapes of real regions), ``dtype`` the floating type of the graph. A base shape is redrawn until
    it holds at most ``max_elems`` elements; values that would grow past it are rewired to parameters."""
    base = _base(rng, shapes)
    for _ in range(20):
        if _elems(base) <= max_elems:
            break
        base = _base(rng, shapes)
    else:
        base = (8, 256)
    rank4 = [s for s in (shapes or []) if len(s) == 4 and _elems(s) <= max_elems] or [(8, 32, 32, 16)]
    params: list[Tensor] = []
    types: list[Tensor] = []
    operands: list[list[tuple[str, int]]] = []
    attrs: list[dict[str, Any]] = []
    rewired = 0

    def param(t: Tensor) -> tuple[str, int]:
        params.append(t)
        return ("p", len(params) - 1)

    def take(src: int | None, want: Tensor) -> tuple[tuple[str, int], Tensor]:
        """Slot ``src`` as an operand of type ``want``: the node where it has that type, else a parameter."""
        nonlocal rewired
        if src is not None:
            if types[src] == want:
                return ("v", src), want
            rewired += 1
        return param(want), want

    for i, (kind, slots) in enumerate(zip(dag.kinds, dag.sources)):
        a: dict[str, Any] = {}
        ops: list[tuple[str, int]] = []
        if kind in ("constant", "iota"):
            out: Tensor = ((), dtype) if kind == "constant" else (base, dtype)
            if kind == "iota":
                a["iota_dimension"] = max(0, len(base) - 1) if base else 0
                if not base:
                    out = ((8,), dtype)
        else:
            primary = _primary_slot(kind, slots)
            src = slots[primary]
            x = _primary_type(kind, types[src] if src is not None else (base, dtype), dtype, base, rank4, rng)
            first, x = take(src, x)
            ops_by_slot: dict[int, tuple[str, int]] = {primary: first}
            out, others = _rule(kind, x, dtype, base, rng, a)
            if _elems(out[0]) > max_elems:          # would grow past the cap: the primary becomes small
                rewired += 1
                x = _primary_type(kind, (base, dtype), dtype, base, rank4, rng)
                first = param(x)
                ops_by_slot[primary] = first
                a.clear()
                out, others = _rule(kind, x, dtype, base, rng, a)
            if primary in others:                  # a later slot of the same type decided it
                want = others.pop(primary)
                others.update({j: want for j in _same_slots(kind, len(slots)) if j != primary and j not in others})
            for j, want in others.items():
                ops_by_slot[j], _ = take(slots[j], want)
            ops = [ops_by_slot[j] for j in range(len(slots))]
        operands.append(ops)
        types.append(out)
        attrs.append(a)
    used = {s for slots in operands for kind_, s in slots if kind_ == "v"}
    results = [i for i in range(len(dag.kinds)) if i not in used]
    return Realised(dag, params, operands, types, attrs, results, rewired)


def _primary_slot(kind: str, slots: list[int | None]) -> int:
    """The operand slot whose type decides a node's shape: for an op whose operands share one type, the
    first fed by an earlier node (a residual ``add`` reads its matrix product in slot 1); else slot 0."""
    same = _same_slots(kind, len(slots))
    return next((j for j in same if slots[j] is not None), same[0])


def _same_slots(kind: str, arity: int) -> tuple[int, ...]:
    """The operand slots of ``kind`` that share one type."""
    if kind == "select":
        return (1, 2)
    return tuple(range(arity)) if kind in BINARY + ("compare", "and") else (0,)


def _primary_type(kind: str, t: Tensor, dtype: str, base, rank4, rng) -> Tensor:
    """The type a node's primary operand must have: ``t`` (the type of what feeds it, or the graph's base
    tensor) where that fits the op, else the nearest type that does."""
    shape, elem = t
    if kind == "and":
        return (shape, "i1")
    if kind == "convolution":
        if len(shape) != 4:
            shape = tuple(rank4[int(rng.integers(len(rank4)))])
        return (shape, elem if elem in FLOATS else dtype)
    if not shape and kind in ("reduce", "dot_general", "slice", "pad", "concatenate"):
        shape = tuple(base) or (8,)
    if kind == "slice" and shape[-1] < 2:
        shape = shape[:-1] + (2,)
    if elem not in FLOATS and kind in UNARY + BINARY + ("reduce", "dot_general", "compare", "select"):
        elem = dtype
    return (shape, elem)


def _rule(kind: str, x: Tensor, dtype: str, base, rng: np.random.Generator,
          a: dict[str, Any]) -> tuple[Tensor, dict[int, Tensor]]:
    """``(result type, {slot: type it needs})`` of ``kind`` on primary operand ``x``; fills ``a``."""
    shape, elem = x
    if kind in UNARY:
        return x, {}
    if kind in BINARY:
        return x, {1: x}
    if kind == "compare":
        a["comparison_direction"] = ("LT", "GT", "EQ", "GE")[int(rng.integers(4))]
        return (shape, "i1"), {1: x}
    if kind == "and":
        return (shape, "i1"), {1: (shape, "i1")}
    if kind == "select":
        return x, {0: (shape, "i1"), 2: x}
    if kind == "convert":
        to = "bf16" if elem == "f32" else "f32"
        return (shape, to), {}
    if kind == "broadcast_in_dim":
        dims = _within(shape, tuple(base))
        if dims is not None:                       # back to the graph's base shape, as a region's are
            out = tuple(base)
        else:
            out = (int(rng.choice((2, 4, 8, 16))),) + shape
            dims = list(range(1, len(out)))
        a["broadcast_dimensions"] = dims
        return (out, elem), {}
    if kind == "reshape":
        if len(shape) >= 2:
            out = shape[:-2] + (shape[-2] * shape[-1],)
        elif len(shape) == 1 and shape[0] % 2 == 0 and shape[0] > 1:
            out = (2, shape[0] // 2)
        else:
            out = shape + (1,)
        return (out, elem), {}
    if kind == "transpose":
        perm = list(range(len(shape)))
        if len(perm) >= 2:
            perm[-1], perm[-2] = perm[-2], perm[-1]
        a["permutation"] = perm
        return (tuple(shape[p] for p in perm), elem), {}
    if kind == "reduce":
        a["dimensions"] = [len(shape) - 1]
        return (shape[:-1], elem), {}
    if kind == "slice":
        a["start"] = [0] * len(shape)
        a["limit"] = list(shape[:-1]) + [math.ceil(shape[-1] / 2)]
        return (shape[:-1] + (math.ceil(shape[-1] / 2),), elem), {}
    if kind == "pad":
        a["low"] = [0] * (len(shape) - 1) + [1] if shape else []
        a["high"] = list(a["low"])
        return (shape[:-1] + (shape[-1] + 2,) if shape else shape, elem), {}
    if kind == "concatenate":
        a["dimension"] = max(0, len(shape) - 1)
        if not shape:
            raise ValueError("concatenate of a scalar")
        return (shape[:-1] + (shape[-1] * 2,), elem), {1: x}
    if kind == "dot_general":
        k = shape[-1]
        n = k if rng.random() < 0.5 else int(rng.choice(GEMM_WIDTHS))
        a["lhs_contracting"] = len(shape) - 1
        return (shape[:-1] + (n,), elem), {1: ((k, n), elem)}
    if kind == "convolution":
        b, h, w, c = shape
        depthwise = c > 1 and rng.random() < 0.3
        k = int(rng.choice((1, 3))) if not depthwise else 3
        stride = int(rng.choice((1, 1, 2))) if min(h, w) >= 2 else 1
        groups = c if depthwise else 1
        o = c if depthwise else int(rng.choice((c, 2 * c, max(1, c // 2))))
        pad = k // 2
        oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
        a.update(stride=stride, pad=pad, groups=groups)
        return ((b, oh, ow, o), elem), {1: ((k, k, c // groups, o), elem)}
    raise ValueError(f"no shape rule for {kind}")


def _within(shape: tuple[int, ...], base: tuple[int, ...]) -> list[int] | None:
    """The dimensions of ``base`` that ``shape`` is (``base`` with some dimensions left out, in order), or
    ``None``."""
    dims: list[int] = []
    j = 0
    for d in shape:
        while j < len(base) and base[j] != d:
            j += 1
        if j == len(base):
            return None
        dims.append(j)
        j += 1
    return dims


def _ty(t: Tensor) -> str:
    shape, elem = t
    return "tensor<" + "".join(f"{d}x" for d in shape) + elem + ">"


def _arr(values) -> str:
    return "array<i64" + (": " + ", ".join(str(int(v)) for v in values) if len(values) else "") + ">"


def _zero(name: str, elem: str) -> str:
    """A scalar zero of ``elem`` named ``name`` (a reduction's initial value, a pad's value)."""
    return f'    {name} = "stablehlo.constant"() {{value = dense<0.000000e+00> : tensor<{elem}>}} : () -> tensor<{elem}>'


def _one(elem: str) -> str:
    return "true" if elem == "i1" else "1.000000e+00"


def _emit(r: Realised, prefix: str, param_refs: list[str]) -> list[str]:
    """The ops of ``r`` (values named ``%<prefix>v<i>``), its parameter ``k`` read as ``param_refs[k]``."""
    emitted: list[str] = []
    extra = 0

    def ref(o: tuple[str, int]) -> str:
        return param_refs[o[1]] if o[0] == "p" else f"%{prefix}v{o[1]}"

    def typ(o: tuple[str, int]) -> Tensor:
        return r.params[o[1]] if o[0] == "p" else r.types[o[1]]

    for i, kind in enumerate(r.dag.kinds):
        ops, a, out = r.operands[i], r.attrs[i], r.types[i]
        ins = ", ".join(ref(o) for o in ops)
        in_types = ", ".join(_ty(typ(o)) for o in ops)
        sig_i = f"({in_types}) -> {_ty(out)}"
        op = f"stablehlo.{kind}"
        if kind == "constant":
            emitted.append(f'    %{prefix}v{i} = "stablehlo.constant"() {{value = dense<{_one(out[1])}> : {_ty(out)}}} : () -> {_ty(out)}')
        elif kind == "iota":
            emitted.append(f'    %{prefix}v{i} = "stablehlo.iota"() {{iota_dimension = {a["iota_dimension"]} : i64}} : () -> {_ty(out)}')
        elif kind == "compare":
            emitted.append(f'    %{prefix}v{i} = "{op}"({ins}) {{comparison_direction = #stablehlo<comparison_direction '
                         f'{a["comparison_direction"]}>}} : {sig_i}')
        elif kind == "broadcast_in_dim":
            emitted.append(f'    %{prefix}v{i} = "{op}"({ins}) {{broadcast_dimensions = {_arr(a["broadcast_dimensions"])}}} : {sig_i}')
        elif kind == "transpose":
            emitted.append(f'    %{prefix}v{i} = "{op}"({ins}) {{permutation = {_arr(a["permutation"])}}} : {sig_i}')
        elif kind == "reduce":
            elem = out[1]
            init, extra = f"%{prefix}c{extra}", extra + 1
            emitted.append(_zero(init, elem))
            emitted.append(f'    %{prefix}v{i} = "stablehlo.reduce"({ins}, {init}) ({{')
            emitted.append(f'    ^bb0(%{prefix}l{i}: tensor<{elem}>, %{prefix}r{i}: tensor<{elem}>):')
            emitted.append(f'      %{prefix}s{i} = "stablehlo.add"(%{prefix}l{i}, %{prefix}r{i}) : (tensor<{elem}>, tensor<{elem}>) -> tensor<{elem}>')
            emitted.append(f'      "stablehlo.return"(%{prefix}s{i}) : (tensor<{elem}>) -> ()')
            emitted.append(f'    }}) {{dimensions = {_arr(a["dimensions"])}}} : ({in_types}, tensor<{elem}>) -> {_ty(out)}')
        elif kind == "slice":
            shape = typ(ops[0])[0]
            emitted.append(f'    %{prefix}v{i} = "{op}"({ins}) {{start_indices = {_arr(a["start"])}, limit_indices = '
                         f'{_arr(a["limit"])}, strides = {_arr([1] * len(shape))}}} : {sig_i}')
        elif kind == "pad":
            elem = out[1]
            value, extra = f"%{prefix}c{extra}", extra + 1
            emitted.append(_zero(value, elem))
            n = len(a["low"])
            emitted.append(f'    %{prefix}v{i} = "{op}"({ins}, {value}) {{edge_padding_low = {_arr(a["low"])}, edge_padding_high = '
                         f'{_arr(a["high"])}, interior_padding = {_arr([0] * n)}}} : ({in_types}, tensor<{elem}>) -> {_ty(out)}')
        elif kind == "concatenate":
            emitted.append(f'    %{prefix}v{i} = "{op}"({ins}) {{dimension = {a["dimension"]} : i64}} : {sig_i}')
        elif kind == "dot_general":
            emitted.append(f'    %{prefix}v{i} = "{op}"({ins}) {{dot_dimension_numbers = #stablehlo.dot<lhs_contracting_dimensions = '
                         f'[{a["lhs_contracting"]}], rhs_contracting_dimensions = [0]>}} : {sig_i}')
        elif kind == "convolution":
            s, p = a["stride"], a["pad"]
            emitted.append(f'    %{prefix}v{i} = "{op}"({ins}) {{batch_group_count = 1 : i64, dimension_numbers = '
                         f'#stablehlo.conv<[b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f]>, feature_group_count = '
                         f'{a["groups"]} : i64, padding = dense<[[{p}, {p}], [{p}, {p}]]> : tensor<2x2xi64>, '
                         f'window_strides = {_arr([s, s])}}} : {sig_i}')
        else:                                       # element-wise, convert, reshape, select
            emitted.append(f'    %{prefix}v{i} = "{op}"({ins}) : {sig_i}')
    return emitted


def module_text(r: Realised, name: str = "synthetic") -> str:
    """``r`` as a StableHLO module (generic op form) whose ``@main`` takes ``r.params`` and returns the
    values of ``r.results``."""
    return program_text([r], name)


def program_text(parts: list[Realised], name: str = "synthetic") -> str:
    """Realised graphs one after another in one module: each parameter of a part reads the first result of
    an earlier part of its type that nothing has read yet (else it is a parameter of ``@main``); ``@main``
    returns every result nothing reads."""
    params: list[Tensor] = []
    available: list[tuple[Tensor, str]] = []
    body: list[str] = []
    for pi, r in enumerate(parts):
        refs = []
        for t in r.params:
            k = next((k for k, (have, _) in enumerate(available) if have == t), None)
            if k is not None:
                refs.append(available.pop(k)[1])
            else:
                params.append(t)
                refs.append(f"%a{len(params) - 1}")
        body.extend(_emit(r, f"g{pi}_", refs))
        available.extend((r.types[i], f"%g{pi}_v{i}") for i in r.results)
    sig = ", ".join(f"%a{k}: {_ty(t)}" for k, t in enumerate(params))
    res = ", ".join(_ty(t) for t, _ in available)
    return "\n".join([f"module @{name} {{", f"  func.func public @main({sig}) -> ({res}) {{", *body,
                      f'    "func.return"({", ".join(v for _, v in available)}) : ({res}) -> ()', "  }", "}"]) + "\n"


def check_module(text: str, source: str = "<synthetic>") -> list[dict[str, Any]]:
    """Parse (MLIR verifies every op), ingest and split a generated module: the records of its compute
    regions (:func:`~hespas_ml.label.region_records.program_records`, one per distinct region, in the
    pipeline's split, so each is what a dataset of real programs would hold), or :class:`InvalidProgram`
    naming the step that refused it."""
    from ..ingest.errors import HespasError
    from ..ingest.stablehlo import parse_module
    from ..label.region_records import program_records
    from ..split.regions import split_program

    try:
        graph = parse_module(text, source)
        found = program_records(split_program(graph))["regions"]
    except (HespasError, ValueError) as exc:
        raise InvalidProgram(f"{source}: {str(exc).splitlines()[0][:300]}") from None
    except Exception as exc:  # noqa: BLE001 - a pipeline bug the module found: counted, with what it was
        first = (str(exc).splitlines() or [""])[0][:300]
        raise InvalidProgram(f"{source}: the pipeline failed on it ({type(exc).__name__}: {first})") from None
    if not found:
        raise InvalidProgram(f"{source}: the split finds no compute region in it")
    return [entry["record"] for entry in found.values()]
