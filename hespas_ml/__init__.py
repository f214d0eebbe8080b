"""hespas-ml: learned-surrogate performance prediction for distributed ML workloads.

StableHLO in, per-device Chakra traces and a network-level step time out. The layers are sub-packages:
``ingest`` (programs -> op graphs), ``split`` (compute regions and collectives), ``label`` (hardware
targets and fidelities), ``replay`` (Chakra traces and ASTRA-sim replay), ``learn`` (surrogates);
``pipeline`` runs them as stages (ingest, split, label, trace, replay) for one question, ``use`` runs the
stages over many (sweeps, studies, layout search, dataset builds) and ``cli`` is the command line.
"""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["simulate", "SimulationResult", "__version__"]


def __getattr__(name):
    # keep `import hespas_ml` light: the pipeline (and jax) load on first use
    if name in ("simulate", "SimulationResult"):
        from . import pipeline
        return getattr(pipeline, name)
    raise AttributeError(f"module 'hespas_ml' has no attribute {name!r}")
