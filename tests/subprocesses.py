"""A test's Python child process, whose failure names what the child printed (not only its exit status)."""

import subprocess
import sys


def run_python(code: str, *args: str, env: dict | None = None, timeout: float = 300) -> str:
    """Runs `python -c code args...` and returns its stdout; a failed child fails the test with its stderr's tail."""
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"child exited {out.returncode}:\n{out.stderr[-3000:]}"
    return out.stdout
