"""MODEL_CARD.md of a trained surrogate: its data, split, model, held-out metrics (with the baselines on the
same rows), provenance and the command that reproduces it. Written beside the saved model
(``hespas-ml train --save DIR``), as shipped in ``hespas_ml/models/<fidelity>/``."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..label.steadiness import describe_log


def _pct(v: Any) -> str:
    return "-" if v is None or v != v else f"{100 * float(v):.2f}%"


def model_card(out, dataset, command: str) -> str:
    """MODEL_CARD.md of a trained surrogate: data, split, metrics on held-out rows, how to reproduce."""
    import torch

    from .. import __version__

    s, c = out.surrogate, out.surrogate.config
    n_params = sum(p.numel() for p in s.net.parameters()) if s.net is not None else 0
    m = dataset.manifest
    counts = (m.get("counts") or {}).get("labels_by_fidelity", {}).get(c.fidelity, {})
    if not counts:                          # a folder collected from measurements: count its labels
        mine = dataset.labels[dataset.labels["fidelity"] == c.fidelity]
        counts = {str(k): int(v) for k, v in mine["status"].value_counts().items()}
    lines = [f"# Learned surrogate of the `{c.fidelity}` fidelity", "",
             f"Use it as `--fidelity surrogate:{c.fidelity}` (`hespas-ml simulate`, sweeps, studies) or "
             f"`hespas-ml predict PROGRAM --fidelity {c.fidelity}`. Files: `weights.pt` (a torch state_dict, "
             "read with `weights_only=True`), `surrogate.json`, `metrics.json` — no pickle.", "",
             "## Data", "",
             f"* dataset: `{Path(dataset.path).name}` (spec `{(m.get('spec') or {}).get('name', '?')}`, built "
             f"{m.get('created', '?')}): {len(dataset.regions)} unique regions; {c.fidelity} labels: "
             + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
             *(["* learned as times inside a program: each label less the dispatch overhead it records "
                "(`in_program`)"] if c.in_program else []),
             f"* targets learned: {', '.join(s.trained_on.get('targets', [])) or '-'}",
             f"* families in training: {', '.join(s.trained_on.get('families', [])) or '-'}",
             *([f"* labelling machine's timing steadiness: {describe_log(dataset.steadiness())}"]
               if c.fidelity == "profiling" else []), "",
             "## Split", "",
             f"* kind: `{c.split}`, holdout {c.holdout or 'default'} (see `hespas_ml/learn/splits.py`), seed {c.seed}",
             f"* rows: {out.split_sizes.get('train')} train, {out.split_sizes.get('val')} validation "
             f"(early stopping and interval calibration), {out.split_sizes.get('test')} test (held out)", "",
             "## Model", "",
             f"* {c.ensemble}-member ensemble GNN, hidden {c.hidden}, {c.layers} layers, head {c.head_hidden}, "
             f"pooling {','.join(c.pooling)}, "
             + (f"predicts the residual over the `{c.base}` estimate" if c.base
                else "predicts log-seconds directly (the analytical estimates are inputs)"),
             f"* {n_params} parameters; {s.metrics.get('epochs_run')} epochs (best {s.metrics.get('best_epoch')}), "
             f"trained in {s.metrics.get('train_s', 0):.0f} s on CPU; interval: {100 * c.interval:.0f}% nominal", "",
             "## Metrics on the held-out test rows", "",
             "| model | median APE | p90 APE | Kendall τ | coverage | rows |", "|---|---|---|---|---|---|"]

    def row(name: str, r: dict[str, Any]) -> str:
        tau = r.get("kendall_tau")
        return (f"| {name} | {_pct(r.get('median_ape'))} | {_pct(r.get('p90_ape'))} | "
                f"{'-' if tau is None or tau != tau else f'{tau:.3f}'} | {_pct(r.get('coverage'))} | {r.get('n', 0)} |")

    lines.append(row("**surrogate**", out.test))
    for k, v in out.baselines.items():
        lines.append(row(f"baseline: {k}", v))
    for group, title in (("per_family", "model family"), ("per_target", "target"), ("per_op", "op family")):
        sub = out.test.get(group) or {}
        if sub:
            lines += ["", f"Per {title} (test rows):", "", f"| {title} | median APE | p90 APE | Kendall τ | "
                      "coverage | rows |", "|---|---|---|---|---|---|"]
            lines += [row(k, v) for k, v in sub.items()]
    val = out.splits.get("val", {})
    lines += ["", f"Validation rows: median APE {_pct(val.get('median_ape'))}, p90 {_pct(val.get('p90_ape'))}, "
                  f"coverage {_pct(val.get('coverage'))}.", "",
              "## Provenance", "",
              f"* trained {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with hespas-ml {__version__}, "
              f"torch {torch.__version__}",
              f"* MLflow run `{out.run_id}`, registered as `{out.name}` version {out.version} "
              "(in the local store used for training; not shipped)", "",
              "## Reproduce", "", "```bash", command, "```", ""]
    if s.domain is not None:
        lines += programs_section(s.domain)
    return "\n".join(lines)


def programs_section(domain) -> list[str]:
    """The card's list of the programs whose regions the model learned, by fingerprint
    (:func:`~hespas_ml.learn.domain.program_fingerprint`: ``simulate`` says ``seen_in_training`` for them)."""
    rows = sorted(domain.programs.items(), key=lambda kv: kv[1])
    return ["## Programs it learned from", "",
            f"{len(rows)} programs held regions it learned; `simulate` says `seen_in_training` for a program whose "
            "fingerprint (a hash of the set of its regions) is one of these, whatever its file or name, and its "
            "figures for such a program are not out of sample.", "",
            "<details><summary>fingerprint, program</summary>", "", "| fingerprint | program |", "|---|---|",
            *(f"| `{fp}` | `{source}` |" for fp, source in rows), "", "</details>", ""]


def save_with_card(out, dataset, folder: str, command: str) -> Path:
    """Save the trained surrogate into ``folder`` with its MODEL_CARD.md."""
    path = out.surrogate.save(folder)
    (path / "MODEL_CARD.md").write_text(model_card(out, dataset, command))
    return path
