"""prima-ctl as the tests run it: a real process where the process is the point (exit status, stderr, what it
imports), in this process through typer's CliRunner where it is not; and the one-line error every failure is."""

import os
import subprocess
import sys

from typer.testing import CliRunner


def ctl(*args: str | bytes, env: dict | None = None, timeout: float = 120, stdin: bytes = b"",
        ) -> subprocess.CompletedProcess:
    """`python -m prima_rpc.app.cli ARGS` in a process of its own; its output as text."""
    res = subprocess.run([sys.executable, "-m", "prima_rpc.app.cli", *args], capture_output=True, input=stdin,
                         env={**os.environ, **(env or {})}, timeout=timeout)
    return subprocess.CompletedProcess(res.args, res.returncode, res.stdout.decode(errors="replace"),
                                       res.stderr.decode(errors="replace"))


def ctl_here(*args: str | bytes, env: dict | None = None) -> subprocess.CompletedProcess:
    """The same command in this process (CliRunner on prima_rpc.app.cli:app, so click's own usage errors are not
    one line here: those stay with `ctl`). Bytes become what the interpreter makes of such an argv."""
    from prima_rpc.app.cli import app

    argv = [os.fsdecode(a) for a in args]
    res = CliRunner().invoke(app, argv, env=env, catch_exceptions=False)
    return subprocess.CompletedProcess(argv, res.exit_code, res.stdout, res.stderr)


def assert_one_line_error(res: subprocess.CompletedProcess, message: str) -> None:
    assert res.returncode != 0, res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert message in lines[0], res.stderr
    assert "Traceback" not in res.stderr and "AioRpcError" not in res.stderr
