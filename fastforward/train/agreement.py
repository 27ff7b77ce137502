"""How often a trained drafter agrees with its target on held-out ``make-data`` records, by draft depth
(``fastforward eval --task agreement``): the number that says whether a drafter learned, before any speed is
measured, and the one its training prints at its end.

Teacher-forced, over the response positions of the held-out split (records ``make-data`` marked held out, never
trained on), each kind of drafter scored as it drafts at decode time (the functions are the trainers' own):

* EAGLE-3 (:func:`fastforward.train.eagle.heldout_agreement`): depth k + 1 is training-time-test step k, reading its
  own earlier outputs;
* FastEagle (:func:`fastforward.train.fasteagle.heldout_agreement`): layer i of the cascade drafts depth i;
* Falcon (:func:`fastforward.train.falcon.heldout_agreement`): the two-pass chain of k-token blocks;
* a draft model (``--method sps``): its next-token top-1 at every position (depth 1; a chain reaches depth d at
  about that rate to the power d).

``top1[d - 1]``: the share of positions whose depth-d draft is the target's token; ``chain[d - 1]``: depths 1..d all
right at once, the rate at which a chain draft reaches depth d.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..drafters.eagle import KNOWN_ARCHITECTURES as EAGLE3_ARCHITECTURES
from ..drafters.falcon import ARCHITECTURE as FALCON_ARCHITECTURE
from ..drafters.fasteagle import ARCHITECTURE as FASTEAGLE_ARCHITECTURE
from ..errors import UsageError

#: a drafter folder's ``architectures[0]`` -> its kind
ARCHITECTURES = {**dict.fromkeys(EAGLE3_ARCHITECTURES, "eagle"), FASTEAGLE_ARCHITECTURE: "fasteagle",
                 FALCON_ARCHITECTURE: "falcon"}


def drafter_kind(folder) -> str:
    """``eagle``, ``fasteagle``, ``falcon`` or ``draft-model`` from a drafter folder (one-line refusals)."""
    from ..drafters.draft_model import is_draft_model

    folder = Path(folder).expanduser()
    path = folder / "config.json"
    if not path.is_file():
        raise UsageError(f"--drafter {folder}: no config.json there")
    if is_draft_model(folder):
        return "draft-model"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        arch = (raw.get("architectures") or [""])[0]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError, TypeError, IndexError) as exc:
        raise UsageError(f"--drafter {folder}: unreadable config.json ({exc})") from None
    if arch not in ARCHITECTURES:
        raise UsageError(f"--drafter {folder}: not a drafter fastforward scores (architecture {arch!r}; expected "
                         "an EAGLE-3, FastEagle, Falcon or draft-model folder)")
    return ARCHITECTURES[arch]


def heldout_records(data, limit: int | None = None) -> list[dict]:
    """The held-out records of a ``make-data`` folder (the first ``limit``), refused in one line when there are
    none."""
    from .make_data import RESPONSES, read_records

    folder = Path(data).expanduser()
    if not (folder / RESPONSES).is_file():
        raise UsageError(f"--data {data}: no {RESPONSES} there (a 'fastforward make-data' folder)")
    held = [r for r in read_records(folder) if r.get("split") == "heldout"][:limit]
    if not held:
        raise UsageError(f"--data {data}: no held-out records")
    return held


def drafter_agreement(folder, target, data, *, limit: int | None = None, steps: int = 3) -> dict:
    """Held-out agreement of the drafter in ``folder`` with ``target`` on the ``make-data`` folder ``data``:
    ``{"kind", "records", "positions", "top1": [...], "chain": [...], "vocab_coverage"}`` (``steps``: depths scored
    for an EAGLE-3 drafter; ``vocab_coverage`` for drafters with a draft vocabulary: :func:`vocab_coverage`).
    Features come from the folder's store where it has them, else the target computes them."""
    import torch

    from ..drafters.features import FeatureStore

    kind = drafter_kind(folder)
    held = heldout_records(data, limit)
    folder = Path(folder).expanduser()
    vocab = None
    with torch.no_grad():
        if kind == "eagle":
            from ..drafters.checkpoint import load_eagle3
            from .eagle import heldout_agreement

            drafter = load_eagle3(folder, target).float().eval()
            vocab = drafter.vocab
            result = heldout_agreement(target, drafter, held, steps, store=FeatureStore(data, target, write=False))
        elif kind == "fasteagle":
            from ..drafters.fasteagle import load_fasteagle
            from .fasteagle import heldout_agreement

            drafter = load_fasteagle(folder, target).float().eval()
            vocab = drafter.vocab
            result = heldout_agreement(target, drafter, held, store=FeatureStore(data, target, write=False))
        elif kind == "falcon":
            from ..drafters.falcon import load_falcon
            from .falcon import heldout_agreement

            drafter = load_falcon(folder, target).float().eval()
            vocab = drafter.vocab
            result = heldout_agreement(target, drafter, held, store=FeatureStore(data, target, write=False))
        else:
            result = _draft_model_agreement(folder, target, held)
    out = {"kind": kind, "records": len(held), "positions": result.get("positions"),
           "top1": [round(float(v), 4) for v in result["top1"]]}
    if result.get("chain") is not None:
        out["chain"] = [round(float(v), 4) for v in result["chain"]]
    if vocab is not None:
        out["vocab_coverage"] = round(vocab_coverage(vocab, held), 4)
    return out


def vocab_coverage(vocab, records: list[dict]) -> float:
    """The share of the records' response tokens inside the draft vocabulary ``vocab`` -- the most any depth's
    top-1 agreement can reach (a token outside it is never drafted)."""
    import torch

    tokens = torch.tensor([t for r in records for t in r["response_ids"]], dtype=torch.long)
    return float(vocab.t2d[tokens].float().mean()) if tokens.numel() else 0.0


def _draft_model_agreement(folder: Path, target, held: list[dict]) -> dict:
    from ..drafters.draft_model import _read_hf_draft
    from .draft_model import _encode, _evaluate

    lm = _read_hf_draft(folder, target)[0]
    encoded, _ = _encode(held, 768)
    scored = _evaluate(lm.float(), encoded, 4)
    if scored is None:
        raise UsageError("the held-out records have no response tokens to score")
    return {"positions": scored["tokens"], "top1": [scored["top1"]], "chain": [scored["top1"]]}
