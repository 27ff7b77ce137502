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
    """The command must fail with exit code 2 and exactly one stderr line, no traceback."""
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and "Traceback" not in out
    assert lines[0].startswith("fastforward")
    if match:
        assert match in lines[0], lines[0]
    return lines[0]
