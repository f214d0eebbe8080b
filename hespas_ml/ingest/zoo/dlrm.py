"""Zoo family ``dlrm``: a deep learning recommendation model (DLRM), as an inference or training step.

Per sample: ``dense`` continuous features and, for each of ``tables`` embedding tables (``rows`` × ``dim``),
``lookups`` integer ids (multi-hot). Each table's rows are gathered and pooled (``pooling=sum`` or
``mean``) into one ``dim``-vector. The dense features go through the bottom MLP (ReLU after every layer,
``bottom`` hidden widths, then ``dim``); its output and the pooled embeddings — ``tables + 1`` vectors —
interact by pairwise dot products (one batched matmul, the strictly lower triangle gathered: ``T(T+1)/2``
values); the top MLP (``top`` hidden widths, ReLU, then one logit) reads those and the bottom output. The
loss is binary cross-entropy with logits against labels in [0, 1]. ``step=train`` differentiates
everything (an embedding table's gradient is a scatter-add of the pooled gradients into a table-sized
zero tensor) and applies SGD, Adagrad or Adam to every parameter, tables included (dense updates).

``devices=N`` with ``parallel``:

* ``dp``: shard_map; every device holds all tables and MLPs and takes ``batch/N`` samples; every gradient
  (tables included) is summed with ``psum``, one all-reduce per parameter, plus the loss.
* ``mp``: the classic DLRM hybrid. The tables are stacked into one ``[tables, rows, dim]`` parameter split
  by table over the devices (``tables/N`` whole tables each) and looked up with one batched gather; a
  device receives the ids of its tables for the whole batch, pools them and an ``all_to_all`` trades the
  pooled vectors so that each device holds every table's vector for its ``batch/N`` samples (backward: the
  reverse all_to_all). The MLPs are data parallel (psum of their gradients); table gradients stay local.
* ``dp-partitioned`` / ``mp-partitioned``: the same layouts given to ``jax.jit`` as shardings, exported
  after XLA's SPMD partitioner (XLA chooses the collectives).

Tables are never allocated: the step is exported from ``jax.ShapeDtypeStruct`` s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import MAX_DEVICES, ParamValue, ZooEntry, ZooParam

PARALLEL = ("dp", "mp", "dp-partitioned", "mp-partitioned")
MAX_TABLE_ELEMENTS = (1 << 31) - 1      # XLA indexes a tensor with 32-bit integers
MAX_EMBEDDING_ELEMENTS = 1 << 36        # all tables together (256 GiB of f32)
MAX_WIDTH = 1 << 20
MAX_MLP_LAYERS = 32
LEARNING_RATE = 0.01
ADAGRAD_EPS = 1e-8


def parse_widths(text: str) -> tuple[int, ...]:
    """``"512,256"`` → ``(512, 256)``; ValueError with a message for the user otherwise."""
    parts = text.replace(" ", "").split(",")
    if not all(part.isdigit() for part in parts):
        raise ValueError(f"{text} is not a list of layer widths (write integers joined by commas, e.g. 512,256)")
    widths = tuple(int(part) for part in parts)
    if any(w < 1 or w > MAX_WIDTH for w in widths):
        raise ValueError(f"{text} has a width outside 1..{MAX_WIDTH}")
    if len(widths) > MAX_MLP_LAYERS:
        raise ValueError(f"{text} has {len(widths)} layers (at most {MAX_MLP_LAYERS})")
    return widths


@dataclass(frozen=True)
class WidthsParam(ZooParam):
    """Hidden-layer widths of an MLP (``512,256``), stored without spaces or leading zeros."""

    def parse(self, text: str) -> ParamValue:
        try:
            value = ",".join(map(str, parse_widths(text)))
        except ValueError as exc:
            raise ValueError(f"{self.name}={exc}") from None
        self.validate(value)
        return value

    def validate(self, value: ParamValue) -> None:
        try:
            parse_widths(str(value))
        except ValueError as exc:
            raise ValueError(f"{self.name}={exc}") from None
        super().validate(value)


PARAMS = (
    ZooParam("tables", int, 8, "embedding tables (sparse features)", minimum=1, maximum=4096),
    ZooParam("rows", int, 100000, "rows of every table", minimum=1, maximum=MAX_TABLE_ELEMENTS),
    ZooParam("dim", int, 64, "embedding width (also the bottom MLP's output width)", minimum=1, maximum=65536),
    ZooParam("lookups", int, 4, "ids per sample and table, pooled into one vector (multi-hot)", minimum=1,
             maximum=65536),
    ZooParam("pooling", str, "sum", "how a sample's rows of one table are combined", choices=("sum", "mean")),
    ZooParam("dense", int, 13, "continuous input features (bottom MLP input)", minimum=1, maximum=MAX_WIDTH),
    WidthsParam("bottom", str, "256,128", "hidden widths of the bottom MLP (its last layer outputs dim)"),
    WidthsParam("top", str, "256,128", "hidden widths of the top MLP (its last layer outputs one logit)"),
    ZooParam("batch", int, 256, "global batch size (samples)", minimum=1, maximum=1 << 24),
    ZooParam("dtype", str, "f32", "element type of tables, weights and activations (loss: f32)",
             choices=("f32", "bf16")),
    ZooParam("step", str, "train", "infer: forward only; train: forward, backward and update",
             choices=("infer", "train")),
    ZooParam("optimizer", str, "sgd", "update rule of a training step (dense, tables included)",
             choices=("sgd", "adagrad", "adam")),
    ZooParam("devices", int, 1, "devices the step runs on", minimum=1, maximum=MAX_DEVICES),
    ZooParam("parallel", str, "dp", "dp: everything replicated, batch split; mp: tables split by table with "
             "all_to_all of pooled embeddings, MLPs data parallel; -partitioned: the same layout, XLA's SPMD "
             "partitioner", choices=PARALLEL),
)


def interactions(tables: int) -> int:
    """Pairwise dot products of ``tables + 1`` vectors (the strictly lower triangle)."""
    return tables * (tables + 1) // 2


def mlp_dims(p: dict[str, Any]) -> tuple[list[int], list[int]]:
    """Layer widths, input first, of the bottom MLP (``dense … dim``) and the top MLP (``dim +
    interactions … 1``)."""
    bottom = [p["dense"], *parse_widths(p["bottom"]), p["dim"]]
    top = [p["dim"] + interactions(p["tables"]), *parse_widths(p["top"]), 1]
    return bottom, top


def parameter_count(p: dict[str, Any]) -> int:
    """Number of trainable parameters: tables and both MLPs (weights and biases)."""
    bottom, top = mlp_dims(p)
    mlp = sum(a * b + b for dims in (bottom, top) for a, b in zip(dims, dims[1:]))
    return p["tables"] * p["rows"] * p["dim"] + mlp


def check(p: dict[str, Any]) -> str | None:
    """A message when the combination of parameters is impossible, else None."""
    table = p["rows"] * p["dim"]
    if table > MAX_TABLE_ELEMENTS:
        return f"a table of rows={p['rows']} x dim={p['dim']} would hold {table} elements " \
               f"(limit {MAX_TABLE_ELEMENTS}); lower rows or dim"
    if table * p["tables"] > MAX_EMBEDDING_ELEMENTS:
        return f"the {p['tables']} tables would hold {table * p['tables']} elements " \
               f"(limit {MAX_EMBEDDING_ELEMENTS}); lower tables, rows or dim"
    n, parallel = p["devices"], p["parallel"]
    if n > 1 and p["batch"] % n:
        return f"batch={p['batch']} is not divisible by devices={n} (parallel={parallel} splits it)"
    if n > 1 and parallel.startswith("mp") and p["tables"] % n:
        return f"tables={p['tables']} is not divisible by devices={n} (parallel={parallel} splits " \
               "the tables over the devices)"
    return None


def forward_flops(p: dict[str, Any], batch: int | None = None) -> dict[str, int]:
    """Analytical matmul FLOPs of one forward pass (multiply-add = 2) for ``batch`` samples (default: the
    global batch): ``first`` (the bottom MLP's first layer, whose input gradient a training step skips),
    ``interaction`` (the batched ``[T+1, dim] x [dim, T+1]`` products) and ``total``. A training step does
    ``3 · total − first``. Gathers, pooling and updates are not matmuls."""
    b = p["batch"] if batch is None else batch
    bottom, top = mlp_dims(p)
    mlp = sum(2 * b * x * y for dims in (bottom, top) for x, y in zip(dims, dims[1:]))
    interaction = 2 * b * (p["tables"] + 1) ** 2 * p["dim"]
    return {"first": 2 * b * bottom[0] * bottom[1], "interaction": interaction, "total": mlp + interaction}


# -- the generator ------------------------------------------------------------------------------------

def _optimizer(kind: str):
    """``(state_of(param shapes), update(params, grads, state))`` for ``sgd``, ``adagrad`` or ``adam``."""
    import jax
    import jax.numpy as jnp

    from .steps import apply_update, opt_shapes

    if kind != "adagrad":
        return (lambda shapes: opt_shapes(shapes, kind)), (lambda w, g, s: apply_update(w, g, s, kind))

    def adagrad(w, g, acc):
        acc = jax.tree.map(lambda a, b: a + b * b, acc, g)
        w = jax.tree.map(lambda x, b, a: x - (LEARNING_RATE * b / (jnp.sqrt(a) + ADAGRAD_EPS)).astype(x.dtype),
                         w, g, acc)
        return w, acc

    return (lambda shapes: shapes), adagrad


def _opt_specs(kind: str, pspec: Any) -> Any:
    from jax.sharding import PartitionSpec as P

    return {"sgd": (), "adagrad": pspec, "adam": (pspec, pspec, P())}[kind]


def generate(p: dict[str, Any]) -> str | bytes:
    """The DLRM step's StableHLO (text; bytecode for a ``-partitioned`` strategy on several devices)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..export import export_jax, export_partitioned
    from .parallel import AXIS, make_mesh

    dtype = jnp.bfloat16 if p["dtype"] == "bf16" else jnp.float32
    n_tab, rows, dim, n_dev = p["tables"], p["rows"], p["dim"], p["devices"]
    strategy = p["parallel"].removesuffix("-partitioned") if n_dev > 1 else "none"
    partitioned = n_dev > 1 and p["parallel"].endswith("-partitioned")
    explicit = strategy != "none" and not partitioned
    stacked = strategy == "mp"
    train = p["step"] == "train"
    bottom_dims, top_dims = mlp_dims(p)
    lower_i, lower_j = np.tril_indices(n_tab + 1, -1)

    def sd(*shape, dt=dtype):
        return jax.ShapeDtypeStruct(shape, dt)

    def mlp_shapes(dims):
        return [{"w": sd(a, b), "b": sd(b)} for a, b in zip(dims, dims[1:])]

    emb = sd(n_tab, rows, dim) if stacked else [sd(rows, dim) for _ in range(n_tab)]
    params = {"emb": emb, "bottom": mlp_shapes(bottom_dims), "top": mlp_shapes(top_dims)}
    dense = sd(p["batch"], p["dense"])
    ids = sd(p["batch"], n_tab, p["lookups"], dt=jnp.int32)
    labels = sd(p["batch"], dt=jnp.float32)

    def pool(looked_up):
        """``[…, lookups, dim]`` → ``[…, dim]``."""
        total = jnp.sum(looked_up, axis=-2)
        return total / p["lookups"] if p["pooling"] == "mean" else total

    def embed_bags(tables, idx):
        """Pooled embeddings ``[batch, tables, dim]`` of ids ``[batch, tables, lookups]``: one gather per
        table, or one batched gather over stacked tables."""
        if stacked:
            rows_of = jax.vmap(lambda t, i: t.at[i].get(mode="promise_in_bounds"), in_axes=(0, 1), out_axes=1)
            return pool(rows_of(tables, idx))
        return jnp.stack([pool(t.at[idx[:, k]].get(mode="promise_in_bounds")) for k, t in enumerate(tables)],
                         axis=1)

    def mlp(layers, x, last_relu):
        for i, layer in enumerate(layers):
            x = x @ layer["w"] + layer["b"]
            if last_relu or i < len(layers) - 1:
                x = jax.nn.relu(x)
        return x

    def forward(w, x_dense, x_ids):
        pooled = embed_bags(w["emb"], x_ids)
        if explicit and strategy == "mp":
            # [batch, tables/N, dim] of this device's tables → [batch/N, tables, dim] of its samples
            pooled = jax.lax.all_to_all(pooled, AXIS, 0, 1, tiled=True)
        z = mlp(w["bottom"], x_dense, last_relu=True)
        features = jnp.concatenate([z[:, None, :], pooled], axis=1)            # [b, T+1, dim]
        dots = jnp.einsum("bid,bjd->bij", features, features)
        flat = dots[:, lower_i, lower_j]                                       # [b, T(T+1)/2]
        return mlp(w["top"], jnp.concatenate([z, flat], axis=1), last_relu=False)[:, 0]

    def bce(logits, y):
        zf = logits.astype(jnp.float32)
        return jnp.mean(jax.nn.softplus(zf) - y * zf)

    opt_init, update = _optimizer(p["optimizer"])
    opt = opt_init(params) if train else ()
    loss_scale = 1.0 / n_dev if explicit else 1.0

    def train_step(w, o, x_dense, x_ids, y):
        loss, grads = jax.value_and_grad(lambda v: bce(forward(v, x_dense, x_ids), y) * loss_scale)(w)
        if explicit:
            replicated = grads if strategy == "dp" else {k: v for k, v in grads.items() if k != "emb"}
            grads = {**grads, **jax.tree.map(lambda g: jax.lax.psum(g, AXIS), replicated)}
            loss = jax.lax.psum(loss, AXIS)
        w, o = update(w, grads, o)
        return w, o, loss

    def infer_step(w, x_dense, x_ids):
        return forward(w, x_dense, x_ids)

    name = f"zoo_dlrm_{p['step']}"
    fn = train_step if train else infer_step
    args = (params, opt, dense, ids, labels) if train else (params, dense, ids)
    if strategy == "none":
        return export_jax(fn, *args, name=name)

    emb_spec = P(AXIS) if stacked else [P() for _ in range(n_tab)]
    pspec = {"emb": emb_spec, "bottom": jax.tree.map(lambda _: P(), params["bottom"]),
             "top": jax.tree.map(lambda _: P(), params["top"])}
    ids_spec = P(None, AXIS) if stacked else P(AXIS)
    in_specs = ((pspec, _opt_specs(p["optimizer"], pspec), P(AXIS), ids_spec, P(AXIS)) if train
                else (pspec, P(AXIS), ids_spec))
    out_specs = (pspec, _opt_specs(p["optimizer"], pspec), P()) if train else P(AXIS)
    mesh = make_mesh(n_dev, partitioned=partitioned)
    if partitioned:
        def named(tree):
            return jax.tree.map(lambda s: NamedSharding(mesh, s), tree, is_leaf=lambda s: isinstance(s, P))
        return export_partitioned(fn, *args, in_shardings=named(in_specs),
                                  out_shardings=named(out_specs) if train else None, name=name)
    # check_vma=False: gradients of replicated parameters stay per-device until the explicit psum.
    step = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return export_jax(step, *args, name=name)


ENTRY = ZooEntry(
    name="dlrm",
    description="DLRM recommendation model (pooled multi-hot embedding tables, bottom/top MLPs, pairwise "
                "dot interaction, BCE); inference or training step (SGD/Adagrad/Adam); dp, or model-parallel "
                "tables with all_to_all; explicit or compiler-partitioned",
    params=PARAMS,
    generate=generate,
    check=check,
)
