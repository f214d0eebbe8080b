"""Learned surrogates: a fidelity's answer for a compute region on a hardware target, in microseconds.

>>> from hespas_ml.learn import Surrogate, TrainConfig
>>> model = Surrogate(TrainConfig(fidelity="scalesim", split="family", holdout=["llama"])).fit(dataset)
>>> model.predict_records(records, "TPUv4").seconds          # also .lower / .upper (calibrated interval)

Modules: :mod:`.config` (TrainConfig, LearnError), :mod:`.features` (region record + target → tensors),
:mod:`.model` (the ensemble GNN), :mod:`.train` (fitting), :mod:`.ensemble` (intervals, Prediction),
:mod:`.surrogate` (Surrogate: fit / predict / save / load / evaluate), :mod:`.splits` (by-region
splits), :mod:`.tables` (label rows, dataset targets), :mod:`.estimates` and :mod:`.baselines` (analytical
estimates, gradient boosting), :mod:`.evaluate` (figures, speed), :mod:`.plots`, :mod:`.model_card`,
:mod:`.tracking` (the MLflow store), :mod:`.registry` (model references, logging, versions),
:mod:`.runs` (one tracked training run), :mod:`.search` (Optuna), :mod:`.fidelity` (``surrogate:<ref>`` as
a pipeline fidelity). Names are imported lazily, so importing the package (or ``.config``) does not import
torch.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "TrainConfig": ".config", "LearnError": ".config", "Surrogate": ".surrogate", "Prediction": ".ensemble",
    "make_split": ".splits", "label_rows": ".tables", "EstimateBaseline": ".baselines",
    "GBMBaseline": ".baselines", "Featuriser": ".features", "measure_speed": ".evaluate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hespas_ml.learn' has no attribute {name!r}")
    return getattr(import_module(module, __name__), name)
