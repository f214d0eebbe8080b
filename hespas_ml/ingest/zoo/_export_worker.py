"""Child process of :func:`hespas_ml.ingest.zoo.cache.export_in_subprocess`: runs one generator.

``python -m hespas_ml.ingest.zoo._export_worker '{"family": …, "params": {…}, "out": PATH}'`` writes
the program to PATH and ``{"kind": "text"|"bytecode"}`` to PATH.json. The parent sets XLA_FLAGS
(fake host devices) before this process imports jax. On failure the last stderr line is
``EXPORT-ERROR <one-line reason>``.
"""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path


def main(argv: list[str]) -> int:
    request = json.loads(argv[1])
    out = Path(request["out"])
    try:
        from . import ZOO
        from ..export import ensure_host_devices

        entry = ZOO[request["family"]]
        params = request["params"]
        ensure_host_devices(max(1, entry.host_devices(params)))
        data = entry.generate(params)
        if isinstance(data, str):
            out.write_text(data, encoding="utf-8")
            kind = "text"
        else:
            out.write_bytes(bytes(data))
            kind = "bytecode"
        out.with_suffix(".json").write_text(json.dumps({"kind": kind}))
        return 0
    except Exception as exc:  # report one line; the traceback goes before it for debugging
        traceback.print_exc()
        first = (str(exc).splitlines() or [""])[0]
        print(f"EXPORT-ERROR {type(exc).__name__}: {first}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
