"""``fastforward calibrate``: fit a drafter's greedy acceptance map (:mod:`fastforward.drafters.calibration`) on the
held-out records of a ``make-data`` folder and store it in the drafter's ``config.json`` -- for EAGLE-3 drafters (ours
or trained elsewhere in that layout) and FastEagle drafters. Training fits the same map at its end; this command
serves drafters trained before it existed or elsewhere, or a new data distribution."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..drafters.calibration import CONFIG_KEY
from ..drafters.eagle import KNOWN_ARCHITECTURES as EAGLE3_ARCHITECTURES
from ..drafters.fasteagle import ARCHITECTURE as FASTEAGLE_ARCHITECTURE
from ..errors import UsageError

KINDS = {**dict.fromkeys(EAGLE3_ARCHITECTURES, "eagle"), FASTEAGLE_ARCHITECTURE: "fasteagle"}


def drafter_kind(folder) -> str:
    """``eagle`` or ``fasteagle`` from a drafter folder's ``config.json`` (one-line refusals otherwise)."""
    path = Path(folder).expanduser() / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        arch = (raw.get("architectures") or [""])[0]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError, TypeError) as exc:
        raise UsageError(f"drafter {folder}: unreadable config.json ({exc})") from None
    if arch not in KINDS:
        raise UsageError(f"drafter {folder}: calibration is for EAGLE-3 and FastEagle drafters, this one is {arch!r}")
    return KINDS[arch]


def calibrate_folder(folder, target, data, *, limit: int | None = None, steps: int = 3) -> dict:
    """Fit the greedy calibration of the drafter in ``folder`` on the held-out records of the ``make-data`` folder
    ``data`` and write it into the drafter's ``config.json`` (only that file changes, atomically). ``steps``: the
    depths fitted for an EAGLE-3 drafter (a FastEagle drafter has one per layer). Returns the held-out scoring
    (``positions``, ``top1``, ``chain``, ``calibration``)."""
    from ..drafters.features import FeatureStore
    from .make_data import read_records

    folder = Path(folder).expanduser()
    kind = drafter_kind(folder)
    held = [r for r in read_records(data) if r.get("split") != "train"][:limit]
    if not held:
        raise UsageError(f"{data}: no held-out records to calibrate on")
    store = FeatureStore(data, target, write=False)
    if kind == "eagle":
        from ..drafters.checkpoint import load_eagle3
        from .eagle import heldout_agreement

        result = heldout_agreement(target, load_eagle3(folder, target).float().eval(), held, steps, store=store)
    else:
        from ..drafters.fasteagle import load_fasteagle
        from .fasteagle import heldout_agreement as fasteagle_agreement

        result = fasteagle_agreement(target, load_fasteagle(folder, target).float().eval(), held, store=store)
    if result["calibration"] is None:
        raise UsageError(f"{data}: the held-out records have no response positions to calibrate on")
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    raw.setdefault("fastforward", {})[CONFIG_KEY] = result["calibration"]
    tmp = folder / f"config.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(raw, indent=2) + "\n")
    os.replace(tmp, folder / "config.json")
    return result
