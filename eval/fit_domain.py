"""Give a saved surrogate its training domain (``hespas_ml/learn/domain.py``), fitted from a dataset folder.

    python eval/fit_domain.py MODEL_DIR DATASET --ood-half-width 0.5 --basis "what showed it" \
        [--label-options '{"budget_s": 2, "memory_gb": 2, "mode": "auto"}']

A model trained now gets its domain at fit, from the very regions it learned. A model trained before that
gets one here: from the regions of ``DATASET`` whose families are those the model learned
(``trained_on.families`` in its ``surrogate.json``), which is the training build itself or a later build of
the same spec (then the domain can be somewhat wider than what the model saw: say so with ``--basis``).
``--ood-half-width``: the log-space half-width of the interval of a region outside the domain (what
held-out families and sizes showed for this model). Only ``surrogate.json`` changes; the weights do not.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hespas_ml.ingest.errors import HespasError  # noqa: E402
from hespas_ml.label.dataset_tables import load_dataset  # noqa: E402
from hespas_ml.learn.domain import Domain, learned_programs  # noqa: E402
from hespas_ml.learn.surrogate import META, Surrogate  # noqa: E402


def fit_domain(model_dir: Path, dataset_dir: Path, ood_half_width: float, basis: str,
               label_options: dict | None = None) -> Domain:
    surrogate = Surrogate.load(model_dir)
    families = set(surrogate.trained_on.get("families") or [])
    ds = load_dataset(dataset_dir)
    regions = ds.regions
    learned = regions["families"].map(lambda fams: bool(families & set(json.loads(fams) if isinstance(fams, str)
                                                                         else fams)))
    chosen = regions[learned] if families else regions
    if chosen.empty:
        raise HespasError(f"{dataset_dir}: no region of the families {sorted(families)} the model learned")
    arrays = surrogate.featuriser.regions_for(list(chosen["hash"]), ds.region_graph)
    fitted_on = (f"the {len(chosen)} regions of the families it learned in dataset {ds.path.name}"
                 + (f" ({basis})" if basis else ""))
    domain = Domain.fit(arrays, surrogate.featuriser.vocabulary, fitted_on=fitted_on, ood_half_width=ood_half_width,
                        label_options=label_options, programs=learned_programs(ds, chosen["hash"]))
    meta_path = model_dir / META
    meta = json.loads(meta_path.read_text())
    meta["domain"] = domain.to_dict()
    meta_path.write_text(json.dumps(meta, indent=1))
    return domain


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path, help="saved surrogate folder (surrogate.json, weights.pt)")
    ap.add_argument("dataset", type=Path, help="dataset folder holding the regions it learned")
    ap.add_argument("--ood-half-width", type=float, required=True,
                    help="log-space interval half-width for a region outside the domain")
    ap.add_argument("--basis", default="", help="where the domain's regions and half-width come from, in words")
    ap.add_argument("--label-options", type=json.loads, default=None, metavar="JSON",
                    help="the labeller options its labels were taken with, e.g. '{\"budget_s\": 2}'")
    args = ap.parse_args(argv)
    if not args.ood_half_width > 0:
        print(f"error: --ood-half-width must be positive, got {args.ood_half_width}", file=sys.stderr)
        return 2
    try:
        domain = fit_domain(args.model, args.dataset, args.ood_half_width, args.basis, args.label_options)
    except (HespasError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"model": str(args.model), "regions": domain.regions, "ops": len(domain.ops),
                      "ood_half_width": domain.ood_half_width}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
