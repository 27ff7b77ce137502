"""Shared helpers for tests that drive the command line in-process."""

from fastforward.cli import main


def run_cli(capsys, *argv):
    """Run ``fastforward ARGV`` in-process; return (exit code, stdout, stderr)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's own errors (unknown flag, bad int) may exit from inside main
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


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
