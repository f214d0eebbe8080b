"""Train / validation / test splits of a dataset's labels, always by region.

Every split first decides which *regions* are tested, so a region is never on both sides; the label rows
(region × target) follow their region. Splits are deterministic functions of the dataset and the config
(``seed`` drives every random choice). Kinds (``TrainConfig.split``):

``family``
    Leave-model-family-out. Test: every region that occurs in a held-out family's programs
    (``regions.families``), including regions it shares with other families — those are left out of
    training too. Default holdout: ``llama`` (else the first model family present). Micro-benchmark
    families and shared files always stay in training.
``size``
    Train small, test large. A region's size is its work, ``flops + bytes`` (region FLOPs plus bytes at
    kernel boundaries, the quantities that set every fidelity's time); the test regions are the largest
    ``holdout[0]`` fraction of regions by work (default ``0.2``), train on the rest.
``array``
    Held-out systolic configurations (SCALE-Sim). Test rows: the held-out targets (default: the
    alphabetically last target the fidelity has) on a random ``test_fraction`` of regions; train and
    validation rows: the other targets on the other regions.
``random``
    A random ``test_fraction`` of regions (only for reference; never the headline figure).

Validation: a random ``val_fraction`` of the training regions.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from .config import LearnError, TrainConfig
from .tables import MODEL_FAMILIES, label_rows


def default_holdout(rows: pd.DataFrame, split: str) -> list[str]:
    """The holdout :func:`make_split` uses when the config names none."""
    if split == "family":
        present = {f for fams in rows["families"] for f in fams}
        for fam in ("llama", *MODEL_FAMILIES):
            if fam in present:
                return [fam]
        raise LearnError("family split: the dataset holds none of the model families "
                         f"{', '.join(MODEL_FAMILIES)}")
    if split == "size":
        return ["0.2"]
    if split == "array":
        return [sorted(set(rows["target"]))[-1]]
    return []


def _pick(regions: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """A random ``fraction`` of ``regions`` (at least one when there are two or more)."""
    n = len(regions)
    k = int(round(fraction * n))
    k = min(max(k, 1 if n > 1 else 0), n - 1 if n > 1 else n)
    return np.sort(rng.permutation(regions)[:k])


def split_regions(rows: pd.DataFrame, config: TrainConfig) -> tuple[set[str], set[str], set[str], list[str]]:
    """(train, validation, test) region hashes and the holdout used."""
    rng = np.random.default_rng(config.seed)
    regions = np.asarray(sorted(set(rows["hash"])))
    holdout = list(config.holdout) if config.holdout else default_holdout(rows, config.split)
    if config.split == "family":
        present = {f for fams in rows["families"] for f in fams}
        unknown = [f for f in holdout if f not in present]
        if unknown:
            raise LearnError(f"family split: no family '{unknown[0]}' in this dataset's {config.fidelity} labels "
                             f"(families: {', '.join(sorted(present))})")
        fams = rows.drop_duplicates("hash").set_index("hash")["families"]
        test = {h for h in regions if set(fams[h]) & set(holdout)}
    elif config.split == "size":
        try:
            fraction = float(holdout[0])
        except (ValueError, IndexError):
            raise LearnError(f"size split: holdout must be one fraction like ['0.2'], got {holdout!r}") from None
        if not 0.0 < fraction < 1.0:
            raise LearnError(f"size split: the held-out fraction must lie in (0, 1), got {fraction}")
        work = rows.drop_duplicates("hash").set_index("hash")["work"].loc[regions].to_numpy()
        order = np.lexsort((regions, work))          # by work, ties by hash
        k = max(1, int(round(fraction * len(regions))))
        test = set(regions[order[len(regions) - k:]])
    elif config.split == "array":
        have = set(rows["target"])
        unknown = [t for t in holdout if t not in have]
        if unknown:
            raise LearnError(f"array split: no {config.fidelity} labels on target '{unknown[0]}' "
                             f"(targets: {', '.join(sorted(have))})")
        if not have - set(holdout):
            raise LearnError("array split: every target is held out; nothing is left to train on")
        test = set(_pick(regions, config.test_fraction, rng))
    else:
        test = set(_pick(regions, config.test_fraction, rng))
    rest = np.asarray([h for h in regions if h not in test])
    if len(rest) == 0 or not test:
        raise LearnError(f"{config.split} split with holdout {holdout}: leaves "
                         f"{len(rest)} training and {len(test)} test regions")
    val = set(_pick(rest, config.val_fraction, rng))
    train = set(rest) - val
    return train, val, test, holdout


def make_split(dataset, config: TrainConfig, rows: pd.DataFrame | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(train, validation, test) label positions (into ``dataset.labels``), sorted, disjoint by region."""
    if rows is None:
        rows = label_rows(dataset, config.fidelity, config.targets, config.max_noise)
    train, val, test, holdout = split_regions(rows, config)
    in_train = rows["hash"].isin(train).to_numpy()
    in_val = rows["hash"].isin(val).to_numpy()
    in_test = rows["hash"].isin(test).to_numpy()
    if config.split == "array":
        held = rows["target"].isin(holdout).to_numpy()
        in_test, in_train, in_val = in_test & held, in_train & ~held, in_val & ~held
    pos = rows["pos"].to_numpy()
    return np.sort(pos[in_train]), np.sort(pos[in_val]), np.sort(pos[in_test])
