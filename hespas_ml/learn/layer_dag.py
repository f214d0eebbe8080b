"""Generators of region graphs: a learned layerwise one (LayerDAG's scheme) and the random baseline.

Both learn from region records (``graphs.parquet`` of a dataset, :mod:`hespas_ml.label.region_records`)
and sample :class:`~hespas_ml.learn.region_programs.TypedDag` s, which
:mod:`~hespas_ml.learn.region_programs` turns into StableHLO modules.

A record becomes a typed DAG (:func:`typed_dag`): its nodes of :data:`OP_KINDS` in their order, each
operand slot fed by an earlier node or by a parameter; an op outside :data:`OP_KINDS` is left out (what it
fed reads a parameter), and a constant that only fed slots the generator does not model (a reduction's
initial value, a pad's value) goes with them.

:class:`LayerDAGGenerator` generates a graph one topological layer at a time, autoregressively: a GRU
carries the layers so far; given it and the layer's index, a head draws how many nodes the layer has (none
ends the graph), a head draws each node's op kind (given the kinds drawn before it in the layer), and for a
node of layer ``l`` > 0 a head picks which of its operand slots reads layer ``l - 1`` and which node of that
layer it reads (that is what puts it in layer ``l``); every other slot reads an earlier node or a parameter,
scored from the node's kind, the slot, the candidate's kind, its layer distance and how often it is used
already. It is fitted by maximum likelihood of the corpus's graphs (teacher forcing) with Adam.

:class:`RandomDagGenerator` is the baseline: as many nodes as a real graph, kinds drawn by the corpus's
frequencies, each slot fed by a uniformly chosen earlier node with the corpus's rate of slots fed inside.
"""
from __future__ import annotations

import json
import math
from typing import Any, Iterable

import numpy as np
import torch
from torch import nn

from .config import LearnError
from .region_programs import ARITY, OP_KINDS, TypedDag, dag_layers

__all__ = ["typed_dag", "LayerDAGGenerator", "RandomDagGenerator", "load_generator"]

MAX_ARITY = max(ARITY.values())


def typed_dag(record: dict[str, Any]) -> TypedDag | None:
    """The typed DAG of a region record (see the module docstring); ``None`` when nothing of it is left."""
    nodes = record["nodes"]
    feeds: dict[tuple[int, int], int] = {(dst, j): src for src, dst, j, _ in record["edges"]}
    users: dict[int, list[tuple[int, int]]] = {}
    for src, dst, j, _ in record["edges"]:
        users.setdefault(src, []).append((dst, j))
    keep = []
    for i, node in enumerate(nodes):
        kind = node["kind"]
        if kind not in ARITY:
            continue
        if kind == "constant":
            uses = users.get(i, [])
            if uses and all(j >= ARITY.get(nodes[d]["kind"], 0) for d, j in uses):
                continue
        keep.append(i)
    index = {old: new for new, old in enumerate(keep)}
    kinds, sources = [], []
    for old in keep:
        kind = nodes[old]["kind"]
        kinds.append(kind)
        sources.append([index.get(feeds.get((old, j), -1)) for j in range(ARITY[kind])])
    if not kinds:
        return None
    return TypedDag(kinds, sources)


def _layers_of(dag: TypedDag) -> list[list[int]]:
    out: list[list[int]] = []
    for i, layer in enumerate(dag.layers):
        while len(out) <= layer:
            out.append([])
        out[layer].append(i)
    return out


class LayerDAGGenerator(nn.Module):
    """The learned generator (module docstring). ``hidden``: width of every embedding and state;
    ``max_width``/``max_layers``: the widest layer and the most layers a graph may have (training graphs
    beyond them are left out); ``epochs``, ``lr``, ``seed``: the fit."""

    def __init__(self, hidden: int = 64, max_width: int = 16, max_layers: int = 24, epochs: int = 30,
                 lr: float = 3e-3, seed: int = 0):
        super().__init__()
        for name, value, low in (("hidden", hidden, 4), ("max_width", max_width, 1), ("max_layers", max_layers, 1),
                                 ("epochs", epochs, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise LearnError(f"generator: {name} must be a whole number of at least {low}, got {value!r}")
        if not lr > 0:
            raise LearnError(f"generator: lr must be positive, got {lr!r}")
        self.config = {"hidden": hidden, "max_width": max_width, "max_layers": max_layers, "epochs": epochs,
                       "lr": lr, "seed": seed}
        with torch.random.fork_rng():              # the seed decides the initial weights, nothing outside
            torch.manual_seed(seed)
            self._build(hidden, max_width, max_layers)
        self.zero_arity = torch.tensor([ARITY[k] == 0 for k in OP_KINDS])
        self.history: list[float] = []
        self.fitted_on = ""                        # what says which graphs it was fitted on (see save)

    def _build(self, hidden: int, max_width: int, max_layers: int) -> None:
        d, v = hidden, len(OP_KINDS)
        self.kind_emb = nn.Embedding(v, d)
        self.layer_emb = nn.Embedding(max_layers + 1, d)
        self.slot_emb = nn.Embedding(MAX_ARITY, d)
        self.dist_emb = nn.Embedding(8, d)
        self.h0 = nn.Parameter(torch.zeros(d))
        self.gru = nn.GRUCell(d, d)
        self.size_head = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, max_width + 1))
        self.within = nn.Linear(d, d)
        self.kind_head = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, v))
        self.anchor_head = nn.Sequential(nn.Linear(2 * d, d), nn.ReLU(), nn.Linear(d, MAX_ARITY))
        self.edge_query = nn.Sequential(nn.Linear(3 * d, d), nn.ReLU(), nn.Linear(d, d))
        self.edge_key = nn.Sequential(nn.Linear(2 * d, d), nn.ReLU(), nn.Linear(d, d))
        self.use_key = nn.Linear(1, d, bias=False)
        self.parameter_score = nn.Sequential(nn.Linear(3 * d, d), nn.ReLU(), nn.Linear(d, 1))

    # -- one graph, teacher forced (``dag`` given) or sampled (``dag`` None) --------------------------
    def _walk(self, dag: TypedDag | None, gen: torch.Generator | None = None
              ) -> tuple[torch.Tensor, TypedDag | None]:
        cfg = self.config
        kind_index = {k: i for i, k in enumerate(OP_KINDS)}
        layers = _layers_of(dag) if dag is not None else None
        h = self.h0
        nll = torch.zeros(())
        kinds: list[int] = []                      # per node so far
        node_layer: list[int] = []
        uses: list[int] = []
        sources: list[list[int | None]] = []
        old_to_new: dict[int, int] = {}
        for l in range(cfg["max_layers"] + 1):
            ctx = h + self.layer_emb(torch.tensor(min(l, cfg["max_layers"])))
            size_logits = self.size_head(ctx)
            if l == 0:                              # a graph has at least one node
                size_logits = size_logits.masked_fill(torch.arange(len(size_logits)) == 0, -1e9)
            if dag is not None:
                n = len(layers[l]) if l < len(layers) else 0
                nll = nll + nn.functional.cross_entropy(size_logits[None], torch.tensor([n]))
            else:
                if l == cfg["max_layers"]:
                    n = 0
                else:
                    n = int(torch.multinomial(torch.softmax(size_logits, -1), 1, generator=gen))
            if n == 0:
                break
            earlier = len(kinds)
            prev_layer = [i for i in range(earlier) if node_layer[i] == l - 1]
            if earlier:
                kinds_emb = self.kind_emb(torch.tensor(kinds))
                cand = kinds_emb + self.dist_emb(torch.tensor([min(l - node_layer[i], 7) for i in range(earlier)]))
                base_keys = self.edge_key(torch.cat([cand, kinds_emb], -1))
            acc = torch.zeros_like(ctx)
            layer_kinds = []
            for k in range(n):
                kctx = ctx + self.within(acc / max(k, 1))
                logits = self.kind_head(kctx)
                if l > 0:
                    logits = logits.masked_fill(self.zero_arity, -1e9)
                if dag is not None:
                    old = layers[l][k]
                    kind = kind_index[dag.kinds[old]]
                    nll = nll + nn.functional.cross_entropy(logits[None], torch.tensor([kind]))
                else:
                    kind = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
                arity = ARITY[OP_KINDS[kind]]
                ek = self.kind_emb(torch.tensor(kind))
                slots: list[int | None] = [None] * arity
                if l > 0 and arity:
                    truth = ([old_to_new.get(s) if s is not None else None for s in dag.sources[old]]
                             if dag is not None else None)
                    # which slot reads the previous layer, and which node of it
                    a_logits = self.anchor_head(torch.cat([kctx, ek]))[:arity]
                    if truth is not None:
                        anchor = next(j for j, s in enumerate(truth) if s is not None and node_layer[s] == l - 1)
                        nll = nll + nn.functional.cross_entropy(a_logits[None], torch.tensor([anchor]))
                    else:
                        anchor = int(torch.multinomial(torch.softmax(a_logits, -1), 1, generator=gen))
                    keys = base_keys + self.use_key(torch.log1p(torch.tensor(uses, dtype=torch.float32))[:, None])
                    for j in range(arity):
                        slot = torch.cat([kctx, ek, self.slot_emb(torch.tensor(j))])
                        q = self.edge_query(slot)
                        scores = keys @ q / math.sqrt(len(q))
                        if j == anchor:
                            mask = torch.ones(earlier, dtype=torch.bool)
                            mask[prev_layer] = False
                            scores = scores.masked_fill(mask, -1e9)
                        else:
                            scores = torch.cat([scores, self.parameter_score(slot)])
                        if truth is not None:
                            want = truth[j] if truth[j] is not None else earlier
                            if j != anchor or truth[j] is not None:
                                nll = nll + nn.functional.cross_entropy(scores[None], torch.tensor([want]))
                            pick = truth[j]
                        else:
                            c = int(torch.multinomial(torch.softmax(scores, -1), 1, generator=gen))
                            pick = c if c < earlier else None
                        slots[j] = pick
                for s in slots:
                    if s is not None:
                        uses[s] += 1
                if dag is not None:
                    old_to_new[layers[l][k]] = len(kinds) + len(layer_kinds)
                layer_kinds.append(kind)
                sources.append(slots)
                acc = acc + ek
            for kind in layer_kinds:
                kinds.append(kind)
                node_layer.append(l)
                uses.append(0)
            h = self.gru(self.kind_emb(torch.tensor(layer_kinds)).mean(0)[None], h[None])[0]
        if dag is not None:
            return nll, None
        return nll, TypedDag([OP_KINDS[k] for k in kinds], sources, node_layer)

    def _fits(self, dag: TypedDag) -> bool:
        layers = _layers_of(dag)
        return (len(layers) <= self.config["max_layers"]
                and max(len(x) for x in layers) <= self.config["max_width"])

    def fit(self, dags: Iterable[TypedDag], progress=None) -> "LayerDAGGenerator":
        """Maximum likelihood on ``dags`` (those within the size limits); ``progress(epoch, epochs, nll)``
        is called after each epoch. ``history`` holds each epoch's mean negative log-likelihood per graph."""
        data = [d for d in dags if d is not None and self._fits(d)]
        if not data:
            raise LearnError("generator: no training graph within the size limits")
        cfg = self.config
        opt = torch.optim.Adam(self.parameters(), lr=cfg["lr"])
        rng = np.random.default_rng(cfg["seed"])
        self.train()
        self.history = []
        for epoch in range(cfg["epochs"]):
            order = rng.permutation(len(data))
            total = 0.0
            for start in range(0, len(order), 16):
                opt.zero_grad()
                loss = torch.zeros(())
                for i in order[start:start + 16]:
                    nll, _ = self._walk(data[i])
                    loss = loss + nll
                (loss / len(order[start:start + 16])).backward()
                opt.step()
                total += float(loss.detach())
            self.history.append(total / len(data))
            if progress is not None:
                progress(epoch + 1, cfg["epochs"], self.history[-1])
        self.eval()
        return self

    def nll(self, dag: TypedDag) -> float:
        """The negative log-likelihood of one graph under the model."""
        with torch.no_grad():
            return float(self._walk(dag)[0])

    def sample(self, n: int, seed: int = 0) -> list[TypedDag]:
        """``n`` graphs; the same ``seed`` gives the same graphs. Graph ``i`` is drawn from
        ``seed``-and-``i``, so any one of them can be drawn again alone (:meth:`sample_one`)."""
        return [self.sample_one(seed, i) for i in range(n)]

    def sample_one(self, seed: int, index: int) -> TypedDag:
        gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(index))
        with torch.no_grad():
            return self._walk(None, gen)[1]

    def save(self, path, fitted_on: str = "") -> None:
        """Weights (``torch.save`` of the state dict), the configuration and ``fitted_on`` (what says which
        graphs it was fitted on), in one file."""
        torch.save({"config": json.dumps(self.config), "kinds": json.dumps(list(OP_KINDS)),
                    "fitted_on": fitted_on, "history": torch.tensor(self.history), "state": self.state_dict()},
                   path)


class RandomDagGenerator:
    """The baseline (module docstring)."""

    def __init__(self, seed: int = 0):
        self.seed = seed

    def fit(self, dags: Iterable[TypedDag]) -> "RandomDagGenerator":
        data = [d for d in dags if d is not None]
        if not data:
            raise LearnError("generator: no training graph")
        counts = np.zeros(len(OP_KINDS))
        index = {k: i for i, k in enumerate(OP_KINDS)}
        inside = slots = 0
        for d in data:
            for kind, src in zip(d.kinds, d.sources):
                counts[index[kind]] += 1
                slots += len(src)
                inside += sum(s is not None for s in src)
        self.kind_p = counts / counts.sum()
        self.sizes = np.array([len(d.kinds) for d in data])
        self.inside = inside / max(slots, 1)
        return self

    def sample_one(self, seed: int, index: int) -> TypedDag:
        rng = np.random.default_rng([int(seed), int(index), 7])
        n = int(self.sizes[rng.integers(len(self.sizes))])
        kinds, sources = [], []
        for i in range(n):
            kind = OP_KINDS[int(rng.choice(len(OP_KINDS), p=self.kind_p))]
            kinds.append(kind)
            sources.append([int(rng.integers(i)) if i and rng.random() < self.inside else None
                            for _ in range(ARITY[kind])])
        return TypedDag(kinds, sources, dag_layers(sources))

    def sample(self, n: int, seed: int = 0) -> list[TypedDag]:
        return [self.sample_one(seed, i) for i in range(n)]


def load_generator(path) -> LayerDAGGenerator:
    """A generator :meth:`LayerDAGGenerator.save` wrote (loaded with ``weights_only=True``)."""
    blob = torch.load(path, weights_only=True)
    if json.loads(blob["kinds"]) != list(OP_KINDS):
        raise LearnError(f"{path}: the generator was trained on other op kinds than this version's")
    model = LayerDAGGenerator(**json.loads(blob["config"]))
    model.load_state_dict(blob["state"])
    model.history = [float(x) for x in blob["history"]]
    model.fitted_on = str(blob.get("fitted_on", ""))
    model.eval()
    return model
