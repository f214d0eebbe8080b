"""Parameter checks and derived sizes shared by the transformer families (no jax: specs are checked
when they are parsed, long before anything is exported)."""
from __future__ import annotations

import math
from typing import Any

from .base import ZooParam


def swiglu_hidden(d_model: int, multiple: int = 128) -> int:
    """Llama's SwiGLU hidden size: 8/3 · d_model rounded up to a multiple of ``multiple``."""
    return multiple * math.ceil(8 * d_model / 3 / multiple)


def check_heads(d_model: int, heads: int, kv_heads: int | None = None, rope: bool = False) -> str | None:
    """A message when the attention head layout is impossible, else None."""
    if d_model % heads:
        return f"d_model={d_model} is not divisible by heads={heads}"
    if rope and (d_model // heads) % 2:
        return f"head size d_model/heads={d_model // heads} is odd (rotary embeddings need an even size)"
    if kv_heads is not None and heads % kv_heads:
        return f"kv_heads={kv_heads} does not divide heads={heads}"
    return None


def check_parallel(p: dict[str, Any], tp_dims: dict[str, int], ep_dims: dict[str, int] | None = None,
                   batch_key: str = "batch") -> str | None:
    """A message when ``p["devices"]`` cannot share the step the way ``p["parallel"]`` says:
    the batch for dp/fsdp/ep, each of ``tp_dims`` for tp, each of ``ep_dims`` for ep."""
    n, parallel = p["devices"], p["parallel"]
    if n == 1:
        return None
    strategy = parallel.removesuffix("-partitioned")
    need: dict[str, int] = {}
    if strategy in ("dp", "fsdp", "ep"):
        need[batch_key] = p[batch_key]
    if strategy == "tp":
        need.update(tp_dims)
    if strategy == "ep":
        need.update(ep_dims or {})
    for name, size in need.items():
        if size % n:
            return f"{name}={size} is not divisible by devices={n} (parallel={parallel} splits it)"
    return None


MESH_AXES = ("pp", "dp", "fsdp", "ep", "cp", "tp")
"""The axes of a several-axis mesh, outermost first: ``tp`` innermost (within a node), then context
parallelism (``cp``: the sequence split), expert parallelism (``ep``: the experts split, the batch too, tokens
sent to their experts and back with all_to_all), fsdp and dp, pipeline stages (``pp``) outermost."""


ROLE_KINDS = ("forward", "backward", "update")
ROLE_PLACES = ("first", "middle", "last")
ROLES = tuple(f"{kind}:{place}" for kind in ROLE_KINDS for place in ROLE_PLACES)
"""What one pipeline stage runs (``role=KIND:PLACE``): a microbatch's ``forward`` or ``backward`` through
``layers`` layers (what the backward needs kept or made again as ``remat`` says), or the stage's optimizer
``update``; the ``first`` stage embeds the tokens, the ``last`` takes the head and the loss, a ``middle`` one
neither."""

MESH_PARAMS = (
    ZooParam("mesh", str, "", "several of pp, dp, fsdp, ep, cp, tp at once, e.g. dp:16,tp:8 or pp:4,dp:4,tp:8 "
             "(their product is devices; tp innermost, pp outermost; cp splits the sequence, its attention "
             "gathering the keys and values; ep splits the experts of a mixture of experts); empty: the one "
             "axis of parallel", optional=True),
    ZooParam("microbatch", int, 0, "sequences per microbatch (0: the whole local batch at once); the local "
             "batch (batch / dp·fsdp) is cut into microbatches: a pipeline's (pp), else accumulated gradients",
             minimum=0, maximum=1 << 20, optional=True),
    ZooParam("schedule", str, "gpipe", "pipeline schedule under pp: gpipe (every microbatch forward, then "
             "every microbatch backward), 1f1b (a training step's forwards and backwards interleaved, so a "
             "stage keeps the activations of the microbatches in flight only; with remat=full; without pp "
             "nothing to schedule) or "
             "interleaved:V (each stage's layers as V chunks, each microbatch round the stages V times: a V "
             "times shorter bubble, V times the messages)", optional=True),
    ZooParam("remat", str, "none", "activation recomputation: none, selective (projections kept, attention "
             "recomputed) or full (each block's input kept)", choices=("none", "selective", "full"),
             optional=True),
    ZooParam("sp", bool, False, "Megatron's sequence parallelism inside tp: between the tensor-parallel "
             "regions the activations are split along the sequence (reduce-scatter and all-gather instead "
             "of all-reduce); without tp nothing", optional=True),
    ZooParam("master", str, "none", "mixed-precision training's master weights: f32 keeps the parameters, "
             "their gradients and the optimizer state in f32 and computes in dtype=bf16 (a bf16 copy of the "
             "parameters made each step, as Megatron-LM and FSDP do); none: everything in dtype",
             choices=("none", "f32"), optional=True),
    ZooParam("dist_opt", bool, False, "Megatron-LM's distributed optimizer: each pipeline stage's optimizer "
             "state (and f32 master weights) sharded over its data-parallel replicas, its gradients "
             "reduce-scattered over them and the updated parameters all-gathered; laid out from the stages' "
             "own programs (simulate --pipeline stages; an update role takes mesh=dp:D[,tp:T], D its shards)",
             optional=True),
    ZooParam("role", str, "", "one pipeline stage's own program (one device, or mesh=tp:T) instead of the step: "
             "forward:PLACE or backward:PLACE (one microbatch of batch sequences through layers layers) or "
             "update:PLACE (the optimizer over a stage of layers layers), PLACE first (embeds), middle or last "
             "(head and loss); empty: the whole step", choices=("", *ROLES), optional=True),
)
"""The parameters of a family laid out on a mesh of several axes (llama, gpt): the mesh, microbatches, the
pipeline schedule and activation recomputation, all left out of the canonical spec at their defaults."""


ATTENTION_PARAM = ZooParam(
    "attention", str, "unfused", "how attention runs: unfused (the scores written out, softmaxed and read back, "
    "as XLA compiles it) or fused (one FlashAttention-style kernel each way: a stand-in custom call the cost "
    "model prices and XLA cannot run, so such programs are not profiled)", choices=("unfused", "fused"),
    optional=True)
"""How the transformer families (llama, gpt) run attention."""


def format_mesh(mesh: dict[str, int]) -> str:
    """``dp:2,tp:4`` of ``{"dp": 2, "fsdp": 1, "tp": 4}`` (the axes of size one left out; ``dp:1`` for none)."""
    return ",".join(f"{a}:{mesh[a]}" for a in MESH_AXES if mesh.get(a, 1) > 1) or "dp:1"


SEARCH_AXES = ("pp", "dp", "fsdp", "tp")
"""The axes a layout search enumerates; a family with experts adds ``ep``. Context parallelism is left out
(cp 1): it pays off only for sequences long enough to need it, which a layout search over one program does
not choose."""


def search_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes a layout search over the zoo family ``entry`` enumerates: :data:`SEARCH_AXES`, and ``ep``
    for a family with experts."""
    return SEARCH_AXES + (("ep",) if entry.param("experts") is not None else ())


def all_meshes(devices: int, axes: tuple[str, ...] = SEARCH_AXES) -> list[dict[str, int]]:
    """Every mesh over ``axes`` (they include dp) whose product is ``devices``, as ``{axis: size}`` in the
    order of :data:`MESH_AXES`, in a fixed order: pp slowest (meshes without a pipeline first), then tp, ep
    and fsdp; dp takes what they leave."""
    chosen = [a for a in ("pp", "tp", "ep", "fsdp") if a in axes]
    out = []

    def walk(i: int, rest: int, sizes: dict[str, int]) -> None:
        if i == len(chosen):
            mesh = sizes | {"dp": rest}
            out.append({a: mesh[a] for a in MESH_AXES if a in mesh})
            return
        for size in range(1, rest + 1):
            if rest % size == 0:
                walk(i + 1, rest // size, sizes | {chosen[i]: size})

    walk(0, devices, {})
    return out


def parse_mesh(text: str) -> dict[str, int]:
    """``{"dp": 2, "tp": 4}`` of ``dp:2,tp:4`` (axes of :data:`MESH_AXES`, each once, sizes ≥ 1); ``{}`` of
    ``""``. Raises ValueError with a one-line message."""
    out: dict[str, int] = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        axis, _, size = item.partition(":")
        axis = axis.strip()
        if axis not in MESH_AXES:
            raise ValueError(f"mesh axis '{axis}' is not one of {', '.join(MESH_AXES)} "
                             "(write e.g. mesh=dp:2,tp:4 or pp:4,dp:2,tp:8)")
        if axis in out:
            raise ValueError(f"mesh axis '{axis}' is given twice")
        if not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"mesh axis '{axis}' needs a size of at least 1 (write {axis}:N)")
        out[axis] = int(size)
    return out


def mesh_of(p: dict[str, Any]) -> dict[str, int]:
    """The mesh a step runs on: ``p["mesh"]`` parsed, else the one axis of an explicit ``parallel`` over
    several devices (``{"tp": 8}``), else ``{}``."""
    if p.get("mesh"):
        return parse_mesh(p["mesh"])
    strategy = p.get("parallel", "dp")
    if p.get("devices", 1) > 1 and strategy in MESH_AXES:
        return {strategy: p["devices"]}
    return {}


def batch_shards(mesh: dict[str, int]) -> int:
    """How many parts the batch is split into on ``mesh``: dp × fsdp × ep."""
    return mesh.get("dp", 1) * mesh.get("fsdp", 1) * mesh.get("ep", 1)


def microbatch_count(p: dict[str, Any], mesh: dict[str, int], batch_key: str = "batch") -> int:
    """How many microbatches a step's local batch is cut into: the batch over dp × fsdp × ep, over
    ``p["microbatch"]`` sequences each (0 or absent: one)."""
    size = p.get("microbatch") or 0
    if not size:
        return 1
    return p[batch_key] // batch_shards(mesh) // size


def schedule_chunks(schedule: str) -> int:
    """How many chunks a pipeline ``schedule`` cuts each stage's layers into: 1 for ``gpipe`` and ``1f1b``, V
    for ``interleaved:V``. Raises ValueError with a one-line message."""
    if schedule in ("gpipe", "1f1b"):
        return 1
    kind, _, chunks = schedule.partition(":")
    if kind != "interleaved":
        raise ValueError(f"schedule={schedule} is not one of gpipe, 1f1b, interleaved:V")
    if not chunks.isdigit() or int(chunks) < 2:
        raise ValueError(f"schedule={schedule}: interleaved needs V ≥ 2 chunks per stage (write interleaved:2)")
    return int(chunks)


def pipeline_bubble(p: dict[str, Any], batch_key: str = "batch") -> float:
    """The share of a step's pipeline ticks in which a stage has no microbatch: (P - 1) / (V·M + P - 1) for P
    stages (``pp``), M microbatches and V chunks per stage (1 for GPipe, V for ``interleaved:V``); 0 without
    a pipeline."""
    mesh = mesh_of(p)
    stages = mesh.get("pp", 1)
    if stages == 1:
        return 0.0
    chunks = schedule_chunks(p.get("schedule", "gpipe"))
    return (stages - 1) / (chunks * microbatch_count(p, mesh, batch_key) + stages - 1)


def check_layout(p: dict[str, Any], tp_dims: dict[str, int], batch_key: str = "batch",
                 ep_dims: dict[str, int] | None = None) -> str | None:
    """A message when ``p`` cannot lay its step out: on its ``mesh`` (:func:`check_mesh`), else on ``devices``
    shared as ``parallel`` says (:func:`check_parallel`) with its microbatches and recomputation; a ``role``
    program runs on one device or a tensor-parallel group (``mesh=tp:T``), a backward or an update only in
    training."""
    if p.get("role"):
        if p.get("microbatch") or p.get("schedule", "gpipe") != "gpipe":
            return f"role={p['role']} is one stage's program at one microbatch: leave microbatch and schedule out"
        if not p["role"].startswith("forward") and p.get("step") != "train":
            return f"role={p['role']} belongs to a training step: give step=train"
        if not p["mesh"]:
            return (f"role={p['role']} runs on one device or on a stage's tensor-parallel group: give mesh=tp:T "
                    f"for {p['devices']} devices") if p.get("devices", 1) > 1 else None
        try:
            mesh = parse_mesh(p["mesh"])
        except ValueError as exc:
            return str(exc)
        sharded = p["role"].startswith("update") and p.get("dist_opt")
        inside = set(mesh) - ({"tp", "dp"} if sharded else {"tp"})
        if inside:
            return (f"role={p['role']} runs on one stage's tensor-parallel group: its mesh takes tp alone"
                    f"{' (and dp, its shards, with dist_opt=true)' if p['role'].startswith('update') else ''}, "
                    f"not {', '.join(sorted(inside))}")
        if sharded and mesh.get("dp", 1) > 1:     # the shards of an update: the batch is no one's
            tp = mesh.get("tp", 1)
            if math.prod(mesh.values()) != p["devices"]:
                return f"mesh={p['mesh']} spans {math.prod(mesh.values())} devices, not devices={p['devices']}"
            return check_mesh({**p, "mesh": f"tp:{tp}" if tp > 1 else "", "devices": tp}, tp_dims, batch_key,
                              ep_dims)
        return check_mesh(p, tp_dims, batch_key, ep_dims)
    if p["mesh"]:
        return check_mesh(p, tp_dims, batch_key, ep_dims)
    return (check_parallel(p, tp_dims, ep_dims, batch_key=batch_key)
            or check_mesh(p, tp_dims, batch_key, ep_dims))


def check_mesh(p: dict[str, Any], tp_dims: dict[str, int], batch_key: str = "batch",
               ep_dims: dict[str, int] | None = None) -> str | None:
    """A message when ``p["mesh"]`` cannot lay out the step: its product is not ``devices``, it is given
    with another ``parallel``, tp does not divide each of ``tp_dims``, ep each of ``ep_dims`` (a model
    without experts takes no ep), dp × fsdp × ep does not divide the batch, pp does not divide the layers;
    or when ``microbatch`` does not divide the local batch."""
    try:
        mesh = parse_mesh(p["mesh"])
    except ValueError as exc:
        return str(exc)
    if mesh:
        if p["parallel"] != "dp":
            return f"mesh={p['mesh']} lays out the devices itself: leave parallel={p['parallel']} out"
        n = math.prod(mesh.values())
        if n != p["devices"]:
            return f"mesh={p['mesh']} spans {n} devices, not devices={p['devices']}"
        for name, size in tp_dims.items():
            if size % mesh.get("tp", 1):
                return f"tp {mesh['tp']} does not divide {name} {size}"
        if p.get("layers", 1) % mesh.get("pp", 1):
            return f"pp {mesh['pp']} does not divide layers {p['layers']}"
        if mesh.get("ep", 1) > 1:
            if not ep_dims:
                return f"ep {mesh['ep']} splits experts: this model has none (the moe family does)"
            for name, size in ep_dims.items():
                if size % mesh["ep"]:
                    return f"ep {mesh['ep']} does not divide {name} {size}"
    elif (p.get("microbatch") or p.get("remat", "none") != "none" or p.get("master", "none") != "none") \
            and p["devices"] > 1 and p["parallel"] not in MESH_AXES:
        return (f"microbatch, remat and master run on a mesh: write mesh={p['parallel'].removesuffix('-partitioned')}:"
                f"{p['devices']} instead of parallel={p['parallel']}")
    try:
        chunks = schedule_chunks(p.get("schedule", "gpipe"))
    except ValueError as exc:
        return str(exc)
    if p.get("dist_opt") and p.get("step") != "train":
        return "dist_opt=true shards a training step's optimizer: it needs step=train"
    if p.get("master", "none") != "none" and (p.get("dtype") != "bf16" or p.get("step") != "train"):
        return (f"master={p['master']} keeps f32 weights beside a bf16 training step: it needs dtype=bf16 and "
                "step=train")
    shards = batch_shards(mesh)
    split = "dp × fsdp × ep" if mesh.get("ep", 1) > 1 else "dp × fsdp"
    if p[batch_key] % shards:
        return f"{split} = {shards} does not divide {batch_key} {p[batch_key]}"
    size = p.get("microbatch") or 0
    if size and (p[batch_key] // shards) % size:
        return (f"microbatch {size} does not divide the {p[batch_key] // shards} sequences each {split} shard "
                f"holds ({batch_key} {p[batch_key]} over {shards})")
    cp = mesh.get("cp", 1)
    if cp > 1 and p.get("seq", 0) % cp:
        return f"cp {cp} does not divide seq {p['seq']}"
    if p.get("sp") and mesh.get("tp", 1) > 1:                  # without tp there is nothing to split
        tp = mesh["tp"]
        if p.get("seq", 0) % (tp * cp):
            return f"sp=true: tp {tp}{f' × cp {cp}' if cp > 1 else ''} does not divide seq {p['seq']}"
    if p.get("schedule") == "1f1b" and mesh.get("pp", 1) > 1:      # without pp there is nothing to schedule
        if p.get("step") == "train" and p.get("remat", "none") != "full":
            return ("schedule=1f1b makes each layer's activations again in its backward: give remat=full "
                    f"(not remat={p.get('remat', 'none')})")
    if chunks > 1:
        stages = mesh.get("pp", 1)
        if stages == 1:
            return f"schedule={p['schedule']} interleaves pipeline stages: give the mesh a pp axis"
        if p.get("layers", 1) % (stages * chunks):
            return (f"schedule={p['schedule']}: pp {stages} × {chunks} chunks does not divide layers "
                    f"{p['layers']}")
        count = microbatch_count(p, mesh, batch_key)
        if count % stages:
            return (f"schedule={p['schedule']}: the {count} microbatches must be a multiple of pp {stages} "
                    "(each comes back to the first stage for its next chunk)")
    return None
