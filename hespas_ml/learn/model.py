"""The surrogate network: an ensemble of GNNs over region graphs, trained and run as one module.

Every layer holds ``members`` independent sets of weights and tensors are member-major
(``[members, nodes, hidden]``), so the ensemble costs one pass of batched matrix products instead of
``members`` separate models; gathers and scatters along the node dimension are shared.

Per member:

* node encoder: standardised node features → linear, plus an opcode embedding;
* ``layers`` × :class:`MemberGINEConv` (GIN with edge features: ``h_i' = MLP((1 + ε) h_i + Σ_j
  ReLU(h_j + W e_ij))``, over edges in both directions), each with a residual connection and layer norm;
* graph readout: the chosen global poolings (sum / mean / max) of the node states;
* head: an MLP over [graph readout, standardised region aggregates, standardised target features
  (hardware vector and, unless disabled, the analytical roofline / systolic estimates)], plus a linear
  path from the region and target features → one number, the standardised log-seconds (or the residual
  over the analytical estimate).

The normalisers of every input and of the output live in buffers, so a state_dict is the whole model.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch_geometric.nn import MessagePassing

from .features import EDGE_FEATURES, NODE_FEATURES, REGION_FEATURES


# Graph readouts of member-major node states [M, N, H] into [M, graphs, H]. They compute what PyG's
# global_{add,mean,max}_pool compute (empty graphs read 0, the same gradients), with index_add_ /
# index_reduce_ along the node dimension instead of scatter with an index broadcast to the states' shape,
# which is 2-5x slower on CPU at the sizes of a prediction call.
def _sum_pool(h: Tensor, batch: Tensor, size: int) -> Tensor:
    return h.new_zeros(h.shape[0], size, h.shape[2]).index_add_(1, batch, h)


def _mean_pool(h: Tensor, batch: Tensor, size: int) -> Tensor:
    count = torch.bincount(batch, minlength=size).clamp_(min=1).to(h.dtype)
    return _sum_pool(h, batch, size) / count.view(1, -1, 1)


def _max_pool(h: Tensor, batch: Tensor, size: int) -> Tensor:
    return h.new_zeros(h.shape[0], size, h.shape[2]).index_reduce_(1, batch, h, "amax", include_self=False)


_POOLS = {"sum": _sum_pool, "mean": _mean_pool, "max": _max_pool}


class MemberLinear(nn.Module):
    """``members`` independent linear maps applied to member-major input ``[members, n, in]`` (or to a
    shared ``[n, in]``, broadcast to every member)."""

    def __init__(self, members: int, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(members, d_in, d_out))
        self.bias = nn.Parameter(torch.empty(members, 1, d_out))
        bound = 1.0 / math.sqrt(d_in)
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2:
            x = x.expand(self.weight.shape[0], -1, -1)
        return torch.baddbmm(self.bias, x, self.weight)


class MemberLayerNorm(nn.Module):
    """Layer norm over the last dimension with a separate affine transform per member."""

    def __init__(self, members: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(members, 1, dim))
        self.bias = nn.Parameter(torch.zeros(members, 1, dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, x.shape[-1:]) * self.weight + self.bias


class MemberGINEConv(MessagePassing):
    """GINE convolution (edge features added to neighbour states before the sum) for every member at once;
    node states are ``[members, nodes, hidden]`` and edge features are shared ``[edges, edge_dim]``."""

    def __init__(self, members: int, hidden: int, edge_dim: int):
        super().__init__(aggr="add", node_dim=1)
        self.edge = MemberLinear(members, edge_dim, hidden)
        self.mlp1 = MemberLinear(members, hidden, hidden)
        self.mlp2 = MemberLinear(members, hidden, hidden)
        self.eps = nn.Parameter(torch.zeros(members, 1, 1))

    def forward(self, x: Tensor, edge_index: Tensor, edge_attr: Tensor) -> Tensor:
        e = self.edge(edge_attr)
        aggr = self.propagate(edge_index, x=x, e=e)
        return self.mlp2(F.relu(self.mlp1((1.0 + self.eps) * x + aggr)))

    def message(self, x_j: Tensor, e: Tensor) -> Tensor:
        return F.relu(x_j + e)

    def aggregate(self, inputs: Tensor, index: Tensor, ptr=None, dim_size: int | None = None) -> Tensor:
        # the sum of messages per target node, as aggr="add" computes it, with index_add_ (faster on CPU
        # than the scatter_add_ over a broadcast index that the default aggregation runs)
        shape = (inputs.shape[0], dim_size if dim_size is not None else int(index.max()) + 1, inputs.shape[2])
        return inputs.new_zeros(shape).index_add_(1, index, inputs)


class Standardise(nn.Module):
    """``(x - mean) / std`` with the statistics in buffers (set by :meth:`fit`).

    A feature that never varied in the training data (e.g. the systolic array shape when every training
    target had 128x128 arrays) gets ``std = inf``: it reads as 0 whatever its value, so a target that
    differs there is answered from what was learned (and from the analytical estimate the model is a
    residual over) instead of from weights that were never trained to mean anything.

    Columns fitted with ``clamp`` (the hardware vector) are first clamped to the range seen in training:
    a target beyond it (a smaller array, a slower clock) is answered as the nearest configuration the
    model knows, and the analytical estimate carries the difference, rather than by extrapolating the
    network's weights into a region they were never fitted on.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("std", torch.ones(dim))
        self.register_buffer("lo", torch.full((dim,), -math.inf))
        self.register_buffer("hi", torch.full((dim,), math.inf))
        self.clamps = False              # whether any column has bounds (else forward skips the clamp)

    def fit(self, x: Tensor, clamp: Tensor | None = None) -> None:
        """Statistics of ``x`` ([rows, dim]); ``clamp`` ([dim] bool) marks the columns to clamp."""
        if x.numel() == 0:
            return
        x = x.reshape(-1, self.mean.numel()).double()
        self.mean.copy_(x.mean(0).float())
        std = x.std(0, unbiased=False).float() if len(x) > 1 else torch.ones_like(self.std)
        self.std.copy_(torch.where(std > 1e-6, std, torch.full_like(std, math.inf)))
        if clamp is not None:
            self.lo.copy_(torch.where(clamp, x.min(0).values.float(), torch.full_like(self.lo, -math.inf)))
            self.hi.copy_(torch.where(clamp, x.max(0).values.float(), torch.full_like(self.hi, math.inf)))
        self._note_bounds()

    def _note_bounds(self) -> None:
        self.clamps = bool(torch.isfinite(self.lo).any() or torch.isfinite(self.hi).any())

    def forward(self, x: Tensor) -> Tensor:
        if self.clamps:
            x = torch.clamp(x, self.lo, self.hi)
        return (x - self.mean) / self.std

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # models saved before clamping existed have no bounds: they load unclamped, as they were trained
        for name, fill in (("lo", -math.inf), ("hi", math.inf)):
            state_dict.setdefault(prefix + name, torch.full_like(getattr(self, name), fill))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._note_bounds()


class SurrogateNet(nn.Module):
    """The ensemble GNN; ``forward(batch)`` returns standardised predictions ``[members, rows]``."""

    def __init__(self, vocab_size: int, row_dim: int, members: int = 5, hidden: int = 64, layers: int = 3,
                 head_hidden: int = 128, pooling: tuple[str, ...] = ("sum", "mean", "max"),
                 dropout: float = 0.0):
        super().__init__()
        self.members, self.pooling, self.dropout = members, tuple(pooling), dropout
        self.node_norm = Standardise(len(NODE_FEATURES))
        self.edge_norm = Standardise(len(EDGE_FEATURES))
        self.region_norm = Standardise(len(REGION_FEATURES))
        self.row_norm = Standardise(row_dim)
        self.register_buffer("y_mean", torch.zeros(()))
        self.register_buffer("y_std", torch.ones(()))
        # the range of the targets it learned (log-seconds or residuals): no answer goes far beyond it
        self.register_buffer("y_lo", torch.full((), -math.inf))
        self.register_buffer("y_hi", torch.full((), math.inf))
        # opcode embedding of the node width, added to the encoded features (index 0: unknown opcode)
        self.embed = nn.Parameter(torch.randn(members, vocab_size + 1, hidden) * (1.0 / math.sqrt(hidden)))
        self.node_in = MemberLinear(members, len(NODE_FEATURES), hidden)
        self.convs = nn.ModuleList(MemberGINEConv(members, hidden, len(EDGE_FEATURES)) for _ in range(layers))
        self.norms = nn.ModuleList(MemberLayerNorm(members, hidden) for _ in range(layers))
        self.graph_in = MemberLinear(members, hidden * len(self.pooling), head_hidden)
        self.side_in = MemberLinear(members, len(REGION_FEATURES) + row_dim, head_hidden)
        self.head1 = MemberLinear(members, head_hidden, head_hidden)
        self.head2 = MemberLinear(members, head_hidden, 1)
        self.skip = MemberLinear(members, len(REGION_FEATURES) + row_dim, 1)   # linear path from the side inputs

    def forward(self, data) -> Tensor:
        x = self.node_norm(data.x)
        edge_attr = self.edge_norm(data.edge_attr)
        h = self.node_in(x) + self.embed.index_select(1, data.op)        # [M, N, H]
        for conv, norm in zip(self.convs, self.norms):
            h = norm(h + F.relu(conv(h, data.edge_index, edge_attr)))
        size = int(data.region.shape[0])
        pooled = torch.cat([_POOLS[p](h, data.batch, size) for p in self.pooling], dim=-1)   # [M, B, P·H]
        side = torch.cat([self.region_norm(data.region).index_select(0, data.row_graph), self.row_norm(data.rows)],
                         dim=-1)
        z = F.relu(self.graph_in(pooled.index_select(1, data.row_graph)) + self.side_in(side))
        if self.dropout:
            z = F.dropout(z, self.dropout, self.training)
        z = F.relu(self.head1(z))
        return (self.head2(z) + self.skip(side)).squeeze(-1)               # [M, rows]

    def to_log_seconds(self, out: Tensor, base: Tensor, residual: bool) -> Tensor:
        """De-standardise ``forward``'s output into log-seconds (adding the analytical base if residual), within
        the range of the targets it learned widened by their standard deviation: a region far from anything
        learned (thousands of nodes where it saw tens) is answered near the edge of what it knows, never at an
        extrapolated 10^20 s."""
        y = torch.clamp(out * self.y_std + self.y_mean, (self.y_lo - self.y_std).to(out.dtype),
                        (self.y_hi + self.y_std).to(out.dtype))
        return y + base if residual else y

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # models saved before the range was kept load unbounded, as they were trained
        for name, fill in (("y_lo", -math.inf), ("y_hi", math.inf)):
            state_dict.setdefault(prefix + name, torch.full((), fill))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
