"""``fastforward calibrate``: fit a drafter's greedy acceptance map on held-out ``make-data`` records
(:mod:`fastforward.drafters.calibration`, :func:`fastforward.train.calibrate.calibrate_folder`)."""

from __future__ import annotations

from pathlib import Path

from ..errors import UsageError
from .options import add_model_arguments, model_load_kwargs, positive_int


def add_arguments(p, name: str) -> None:
    add_model_arguments(p)
    p.add_argument("--drafter", required=True,
                   help="an EAGLE-3 (ours or one trained elsewhere) or FastEagle drafter folder; its config.json is "
                        "updated")
    p.add_argument("--data", required=True, help="a 'fastforward make-data' folder: its held-out records are used")
    p.add_argument("--limit", type=positive_int, default=None, help="the first N held-out records only")
    p.add_argument("--steps", type=positive_int, default=3,
                   help="depths to fit for an EAGLE-3 drafter (default: 3; FastEagle: one per layer)")


def run(args, name: str) -> int:
    import fastforward as ff

    from ..train.calibrate import calibrate_folder, drafter_kind

    for flag, path, what in (("--drafter", args.drafter, "config.json"), ("--data", args.data, "responses.jsonl")):
        if not (Path(path).expanduser() / what).is_file():
            raise UsageError(f"{flag} {path}: no {what} there")
    drafter_kind(args.drafter)  # refused before the model loads
    target = ff.load(args.model, **model_load_kwargs(args))
    result = calibrate_folder(args.drafter, target, args.data, limit=args.limit, steps=args.steps)
    cal = result["calibration"]
    print(f"calibrated {args.drafter} on {result['positions']} held-out response positions "
          f"({cal['samples']} candidates); top-1 agreement by depth "
          + " ".join(f"{v:.3f}" for v in result["top1"]))
    for d, (x, y) in enumerate(zip(cal["knots"], cal["rates"], strict=True), start=1):
        pts = [(q, r) for q, r in zip(x, y, strict=True) if 0 < q < 1]
        n = len(pts)
        picks = [pts[i] for i in sorted({0, n // 4, n // 2, 3 * n // 4, n - 1})] if pts else []
        print(f"  depth {d}: " + ", ".join(f"q {q:.2f} -> {r:.2f}" for q, r in picks))
    return 0
