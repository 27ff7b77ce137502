"""Trained drafters: the modules that drafter training and inference both import.

* :mod:`.features` -- the target features drafters read (taps inside the target, its final state), stored or computed;
* :mod:`.vocab` -- the reduced draft vocabulary (``d2t`` / ``t2d``);
* :mod:`.pieces` -- what every drafter is built from (the target's fingerprint and rows, config checks, norms,
  RoPE, layers, decode-time linears);
* :mod:`.eagle` -- the EAGLE-3-style drafter (training module and decode-time runner); :mod:`.checkpoint` -- its
  native EAGLE-3 folder layout (what vLLM and SGLang load); :mod:`.fasteagle` and :mod:`.falcon` -- the FastEagle
  and Falcon drafters;
* drafters for the default model ship in ``shipped/`` (each with the exact command that trained it), found by
  :func:`shipped_drafter` from the target's fingerprint.
"""

from __future__ import annotations

import json
from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"


def shipped_drafter(target, kind: str) -> Path | None:
    """The shipped drafter folder of ``kind`` ('eagle3', 'draft-model', ...) trained for ``target``, if any."""
    if not SHIPPED_DIR.is_dir():
        return None
    from .pieces import target_fingerprint

    fingerprint = None
    for folder in sorted(p for p in SHIPPED_DIR.iterdir() if (p / "config.json").is_file()):
        try:
            cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        meta = cfg.get("fastforward") or cfg.get("fastforward_draft_model") or {}
        if meta.get("kind", "eagle3" if "fastforward" in cfg else "draft-model") != kind:
            continue
        fingerprint = fingerprint or target_fingerprint(target)
        if meta.get("target_fingerprint") == fingerprint:
            return folder
    return None
