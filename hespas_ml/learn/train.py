"""Training of the surrogate network: label rows → per-region PyG data → an early-stopped ensemble fit.

:func:`region_dataset` turns label rows (region × target) into one :class:`RegionData` per region holding
all its rows, so the graph network runs once per region and its readout is shared by that region's
targets. :func:`train_network` runs the optimisation: AdamW with a cosine schedule, a per-member loss
weighted by each member's bootstrap weights, validation after every epoch on the members' mean, early
stopping with ``patience``, and the best epoch's weights restored at the end.
"""
from __future__ import annotations

import copy
import math
import random
import time
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch
from torch.nn import functional as F
from torch_geometric.loader import DataLoader

from .config import TrainConfig
from .features import HW_FEATURES, Featuriser, RegionData, region_data
from .model import SurrogateNet

EpochCallback = Callable[[int, dict[str, float]], bool]


def seed_everything(seed: int) -> torch.Generator:
    """Seed python, numpy and torch; returns a torch generator for data order."""
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def region_dataset(rows: pd.DataFrame, load: Callable[[str], dict], targets: dict[str, Any], featuriser: Featuriser,
                   columns: np.ndarray, members: int = 1, bootstrap_rng: np.random.Generator | None = None,
                   base: str = "roofline") -> list[RegionData]:
    """One :class:`RegionData` per region of ``rows`` (columns ``hash``, ``target``, ``seconds``) with
    all its rows. ``load(hash)`` gives a region's record (called only for regions the featuriser has not
    cached); ``columns`` selects the target features the model sees and ``base`` the analytical estimate
    kept as each row's ``base``. With ``bootstrap_rng`` each region gets Poisson(1) weights per member
    (the same for all its rows), else weight 1."""
    if rows.empty:
        return []
    hashes = rows["hash"].to_numpy()
    uniq = list(dict.fromkeys(hashes))
    arrays_of = dict(zip(uniq, featuriser.regions_for(uniq, load)))
    feats = np.zeros((len(rows), len(columns)), dtype=np.float32)
    base_s = np.zeros(len(rows))
    tnames = rows["target"].to_numpy()
    for name in pd.unique(tnames):
        sel = np.flatnonzero(tnames == name)
        f, est = featuriser.target_features([arrays_of[h] for h in hashes[sel]], targets[name])
        feats[sel] = f[:, columns]
        base_s[sel] = est[base]
    y = np.log(rows["seconds"].to_numpy(dtype=np.float64))
    order = np.argsort(hashes, kind="stable")
    sorted_hashes, starts = np.unique(hashes[order], return_index=True)
    ends = np.append(starts[1:], len(order))
    out = []
    for h, s, e in zip(sorted_hashes, starts, ends):
        idx = order[s:e]
        w = bootstrap_rng.poisson(1.0, size=members).astype(np.float32) if bootstrap_rng is not None \
            else np.ones(members, dtype=np.float32)
        out.append(region_data(arrays_of[h], feats[idx], base_s[idx], y[idx], np.broadcast_to(w, (len(idx), members))))
    return out


def _loss(kind: str, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if kind == "mse":
        return F.mse_loss(pred, target, reduction="none")
    if kind == "l1":
        return F.l1_loss(pred, target, reduction="none")
    return F.huber_loss(pred, target, reduction="none", delta=1.0)


def fit_normalisers(net: SurrogateNet, train: list[RegionData], residual: bool) -> None:
    """Set the network's input and output normalisers from the training data."""
    net.node_norm.fit(torch.cat([d.x for d in train]))
    edges = [d.edge_attr for d in train if d.edge_attr.numel()]
    if edges:
        net.edge_norm.fit(torch.cat(edges))
    net.region_norm.fit(torch.cat([d.region for d in train]))
    rows = torch.cat([d.rows for d in train])
    hardware = torch.zeros(rows.shape[-1], dtype=torch.bool)
    hardware[rows.shape[-1] - len(HW_FEATURES):] = True          # the hardware vector closes every row
    net.row_norm.fit(rows, clamp=hardware)
    y = torch.cat([d.y - d.base if residual else d.y for d in train]).double()
    net.y_mean.fill_(float(y.mean()))
    net.y_std.fill_(max(float(y.std(unbiased=False)) if len(y) > 1 else 1.0, 1e-2))
    net.y_lo.fill_(float(y.min()))
    net.y_hi.fill_(float(y.max()))


@torch.no_grad()
def predict_members(net: SurrogateNet, data: list[RegionData], residual: bool, batch_size: int = 1024
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(member log-seconds [members, rows], truth [rows]) over ``data`` in its row order."""
    net.eval()
    preds, ys = [], []
    for batch in DataLoader(data, batch_size=batch_size, shuffle=False):
        preds.append(net.to_log_seconds(net(batch), batch.base, residual).double().numpy())
        ys.append(batch.y.double().numpy())
    return np.concatenate(preds, axis=1), np.concatenate(ys)


def _val_metrics(net: SurrogateNet, val: list[RegionData], config: TrainConfig) -> dict[str, float]:
    members, y = predict_members(net, val, config.base is not None)
    mean = members.mean(0)
    ape = np.abs(np.expm1(mean - y))
    std_y = float(net.y_std)
    loss = float(_loss(config.loss, torch.from_numpy((mean - y) / std_y), torch.zeros(len(y))).mean())
    return {"val_loss": loss, "val_median_ape": float(np.median(ape)), "val_p90_ape": float(np.quantile(ape, 0.9))}


def train_network(net: SurrogateNet, train: list[RegionData], val: list[RegionData], config: TrainConfig,
                  generator: torch.Generator, on_epoch: EpochCallback | None = None) -> list[dict[str, float]]:
    """Optimise ``net`` in place; returns the per-epoch history (the best epoch's weights are kept)."""
    opt = torch.optim.AdamW(net.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=config.epochs, eta_min=config.lr / 20)
    loader = DataLoader(train, batch_size=config.batch_size, shuffle=True, generator=generator, drop_last=False)
    best, best_state, since, history = math.inf, copy.deepcopy(net.state_dict()), 0, []
    for epoch in range(config.epochs):
        t0 = time.perf_counter()
        net.train()
        total, weight = 0.0, 0.0
        for batch in loader:
            out = net(batch)                                            # [M, R]
            target = batch.y - batch.base if config.base is not None else batch.y
            target = (target - net.y_mean) / net.y_std
            w = batch.w.t()                                             # [M, R]
            per = _loss(config.loss, out, target.unsqueeze(0).expand_as(out)) * w
            denom = w.sum(1).clamp_min(1.0)
            loss = (per.sum(1) / denom).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 5.0)
            opt.step()
            total += float(loss.detach()) * out.shape[1]
            weight += out.shape[1]
        sched.step()
        metrics = {"epoch": epoch, "train_loss": total / max(weight, 1.0), "lr": opt.param_groups[0]["lr"]}
        if val:
            metrics.update(_val_metrics(net, val, config))
            score = metrics["val_loss"]
        else:
            score = metrics["train_loss"]
        metrics["seconds"] = time.perf_counter() - t0
        history.append(metrics)
        if score < best - 1e-6:
            best, best_state, since = score, copy.deepcopy(net.state_dict()), 0
        else:
            since += 1
        if on_epoch is not None and on_epoch(epoch, dict(metrics)) is False:
            break
        if since > config.patience:
            break
    net.load_state_dict(best_state)
    return history
