"""Configuration of a learned surrogate: one plain, JSON-serialisable dataclass, and the learn errors.

:class:`TrainConfig` says which labels to learn (fidelity, targets), how to split the dataset, the model
and its training, the ensemble and its interval. ``dataclasses.asdict(config)`` is its JSON form and
:meth:`TrainConfig.from_dict` reads it back (unknown keys are refused, so a config from another version
is a clear error rather than a silent default).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..ingest.errors import HespasError

FIDELITIES = ("roofline", "scalesim", "profiling")
SPLITS = ("family", "size", "array", "random")
POOLINGS = ("sum", "mean", "max")
LOSSES = ("mse", "huber", "l1")
BASES = ("auto", "roofline", "systolic", "calibrated", "none")


class LearnError(HespasError, ValueError):
    """A surrogate cannot be trained, loaded or asked: ``<file or thing>: <problem>`` on one line."""


@dataclass
class TrainConfig:
    """Everything that defines a trained surrogate; every field has a default."""

    # what to learn
    fidelity: str = "roofline"            # roofline | scalesim | profiling
    targets: list[str] | None = None      # restrict to these targets (None: all the dataset has)
    max_noise: float | None = None        # drop labels whose measurement noise (IQR/median) is above this
    in_program: bool = False              # learn measured times less the dispatch overhead their labels record
                                          #   (device labels: a region's time inside a program, as the
                                          #   measured fidelity answers; hespas_ml.learn.tables.in_program_labels)
    # how to split (see hespas_ml.learn.splits)
    split: str = "family"                 # family | size | array | random
    holdout: list[str] | None = None      # held-out families / targets / size fraction (None: default)
    val_fraction: float = 0.15            # share of the training regions kept for validation
    test_fraction: float = 0.2            # random / array splits: share of regions held out for test
    # model (hespas_ml.learn.model)
    hidden: int = 32                      # node / graph embedding width (32: the ensemble of 5 keeps ≥ 5k regions/s)
    layers: int = 3                       # message-passing layers
    dropout: float = 0.0
    pooling: list[str] = field(default_factory=lambda: ["sum", "mean", "max"])
    head_hidden: int = 64                 # width of the MLP that joins graph, region and hardware
    residual: bool = True                 # learn log(label) - log(analytical estimate)
    residual_base: str = "auto"           # roofline | systolic (fold estimate on systolic targets,
                                          #   roofline elsewhere) | calibrated (the calibrated roofline on
                                          #   targets measured for one, roofline elsewhere) | none | auto
                                          #   (scalesim: systolic, profiling: none — host overheads dwarf the
                                          #   roofline — else roofline)
    roofline_input: bool = True           # give the model the analytical estimate (and its parts)
    systolic_input: bool = True           # … and the systolic fold estimate (with roofline_input)
    # training
    lr: float = 3e-3
    weight_decay: float = 1e-5
    epochs: int = 60
    batch_size: int = 256                 # regions per batch (each with all its label rows)
    patience: int = 10                    # epochs without validation improvement before stopping
    loss: str = "huber"                   # mse | huber | l1, on standardised log-seconds
    # uncertainty (hespas_ml.learn.ensemble)
    ensemble: int = 5                     # members, trained together with their own seeds / bootstraps
    bootstrap: bool = True                # members see Poisson(1)-weighted regions
    interval: float = 0.9                 # nominal coverage of the prediction interval
    # reproducibility and resources
    seed: int = 0
    threads: int = 1                      # torch intra-op threads (on a shared 2-core box, 2 spin and crawl)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`LearnError` naming the first bad field."""
        def bad(name: str, why: str) -> LearnError:
            return LearnError(f"TrainConfig.{name}: {why} (got {getattr(self, name)!r})")

        if self.fidelity not in FIDELITIES:
            raise bad("fidelity", f"must be one of {', '.join(FIDELITIES)}")
        if self.split not in SPLITS:
            raise bad("split", f"must be one of {', '.join(SPLITS)}")
        if self.residual_base not in BASES:
            raise bad("residual_base", f"must be one of {', '.join(BASES)}")
        if self.loss not in LOSSES:
            raise bad("loss", f"must be one of {', '.join(LOSSES)}")
        if not self.pooling or any(p not in POOLINGS for p in self.pooling):
            raise bad("pooling", f"must be a non-empty list of {', '.join(POOLINGS)}")
        for name in ("hidden", "layers", "head_hidden", "epochs", "batch_size", "ensemble", "threads"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise bad(name, "must be a positive integer")
        if self.patience < 0:
            raise bad("patience", "must be >= 0")
        if not 0.0 < self.interval < 1.0:
            raise bad("interval", "must lie strictly between 0 and 1")
        for name in ("val_fraction", "test_fraction"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise bad(name, "must lie strictly between 0 and 1")
        if not 0.0 <= self.dropout < 1.0:
            raise bad("dropout", "must lie in [0, 1)")
        if self.lr <= 0 or self.weight_decay < 0:
            raise bad("lr", "lr must be positive and weight_decay non-negative")
        if self.residual and not self.roofline_input:
            raise bad("residual", "a residual over the roofline estimate needs roofline_input=True")

    @property
    def base(self) -> str | None:
        """The analytical estimate the model's output is relative to (``roofline``, ``systolic`` or
        ``calibrated``), or None when it predicts log-seconds directly."""
        if not self.residual:
            return None
        if self.residual_base == "auto":
            return {"scalesim": "systolic", "profiling": None}.get(self.fidelity, "roofline")
        return None if self.residual_base == "none" else self.residual_base

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], origin: str = "config") -> "TrainConfig":
        """A config from its dict form; ``origin`` (e.g. a file name) prefixes any error."""
        if not isinstance(data, dict):
            raise LearnError(f"{origin}: a TrainConfig must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise LearnError(f"{origin}: unknown TrainConfig field '{unknown[0]}'")
        try:
            return cls(**data)
        except LearnError as exc:
            raise LearnError(f"{origin}: {exc}") from None
        except TypeError as exc:
            raise LearnError(f"{origin}: {exc}") from None


def read_yaml(path: str | os.PathLike[str], what: str, error: type[LearnError] = LearnError) -> Any:
    """The parsed YAML file ``path`` (a ``what`` file); a missing or malformed file is one ``error`` line."""
    import yaml

    p = Path(path)
    try:
        return yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise error(f"{p}: no such {what} file") from None
    except (OSError, yaml.YAMLError) as exc:
        raise error(f"{p}: unreadable ({' '.join(str(exc).split())[:160]})") from None


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The TrainConfig fields of a YAML file (a flat mapping)."""
    p = Path(path)
    data = read_yaml(p, "configuration")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise LearnError(f"{p}: expected a mapping of TrainConfig fields")
    for k in ("lr", "weight_decay", "dropout", "max_noise"):
        if isinstance(data.get(k), str):          # YAML 1.1 reads 1e-4 as a string
            try:
                data[k] = float(data[k])
            except ValueError:
                pass
    return data
