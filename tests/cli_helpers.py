"""Shared helpers for tests that drive the command line in-process."""

import re

from fastforward.cli import main

#: The live cost model's notices (fastforward/costs.py). They may come from any command that decodes, whenever this
#: process measures a curve or its timings contradict a curve that an earlier test cached in the session's cache (on
#: a machine whose speed varies): what a test checks of a command's own output must not depend on them.
COST_CURVE_NOTICE = re.compile(r"^fastforward: (measuring this machine's forward cost curve|the cost curve |"
                               r"this run's forward timings contradict the cached cost curve).*\n", re.MULTILINE)


def without_cost_curve_notices(err: str) -> str:
    """``err`` without the lines of the live cost model's notices (a line ends at a newline only: a progress line
    rewritten in place with carriage returns stays as it was)."""
    return COST_CURVE_NOTICE.sub("", err)


def run_cli(capsys, *argv):
    """Run ``fastforward ARGV`` in-process; return (exit code, stdout, stderr), stderr without the live cost model's
    notices (:data:`COST_CURVE_NOTICE`; tests/test_costs.py checks those)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's own errors (unknown flag, bad int) may exit from inside main
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, without_cost_curve_notices(err)


def assert_one_line_error(capsys, *argv, match=None):
    """The command must fail with exit code 2 and exactly one stderr line, no traceback (:func:`one_line_exit_2`)."""
    return one_line_exit_2(capsys, *argv, match=match)


def one_line_exit_2(capsys, *argv, match=None) -> str:
    """``fastforward ARGV`` must fail as bad input does: exit code 2, one stderr line starting with "fastforward",
    no traceback, no "internal error" (and ``match`` in the line, when given); returns the line. ``argv`` may be
    given as arguments or as one list of them."""
    if len(argv) == 1 and isinstance(argv[0], (list, tuple)):
        argv = tuple(argv[0])
    code, out, err = run_cli(capsys, *argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out, err)
    assert len(lines) == 1, err
    assert "Traceback" not in err + out and "internal error" not in err
    assert lines[0].startswith("fastforward"), lines[0]
    if match is not None:
        assert match in lines[0], lines[0]
    return lines[0]


def fill(files: dict, argv) -> list:
    """``argv`` with the placeholders of a ``files`` fixture ({placeholder: path}) replaced by their paths."""
    out = []
    for arg in argv:
        if isinstance(arg, str):
            for key, value in files.items():
                arg = arg.replace(key, value)
        out.append(arg)
    return out
