"""prima.cpp (github.com/Lizonghang/prima.cpp) for side-by-side ring rows: found or built on demand, never a dependency.

`find_llama_cli(DIR)`: DIR is a build (holds llama-cli), a source tree (a Makefile: copied to the cache and built
there) or a bare git directory (its HEAD archived to the cache and built); no DIR: a build in the cache
($PRIMA_HOME/prima.cpp/*/llama-cli). ZeroMQ comes from Debian's libzmq3-dev; no HiGHS is needed, as the windows
are given with -lw. `ring_tpot` runs one llama-cli per rank inside `unshare -n` (`-rn` when not root): its ranks
bind tcp://* on ports 9000+rank and 10000+rank, and a fresh network namespace leaves them only its loopback.
"""

import hashlib
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from prima_rpc.spec.home import prima_home

PROMPT = "Write a short story about a robot who learns to paint."
EVAL = re.compile(r"llama_perf_context_print:\s+eval time =\s+([\d.]+) ms /\s+(\d+) runs")


class PrimaCppMissing(Exception):
    """No prima.cpp build to run, and why (printed as the benchmark's 'no prima.cpp build' line)."""


def cache_dir() -> Path:
    return prima_home() / "prima.cpp"


def find_llama_cli(where: Path | None) -> Path:
    """A llama-cli of prima.cpp, built into the cache from `where` when it is a source (slow: ~15 min on 2 cores)."""
    if where is None:
        built = sorted(cache_dir().glob("*/llama-cli"))
        if not built:
            raise PrimaCppMissing(f"no prima.cpp build in {cache_dir()}; pass --prima-cpp DIR (a source tree, a "
                                  "bare git directory or a build)")
        return built[-1]
    if (where / "llama-cli").is_file():
        return where / "llama-cli"
    if (where / "Makefile").is_file():
        out = cache_dir() / f"tree-{hashlib.sha256(str(where.resolve()).encode()).hexdigest()[:12]}"
        if not out.exists():
            shutil.copytree(where, out, ignore=shutil.ignore_patterns(".git", "*.o"))
        return build(out)
    if (where / "HEAD").is_file() and (where / "objects").is_dir():
        commit = subprocess.run(["git", "--git-dir", str(where), "rev-parse", "--short=8", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
        out = cache_dir() / commit
        if not (out / "Makefile").is_file():
            archive(where, out)
        return build(out)
    raise PrimaCppMissing(f"{where} is neither a prima.cpp build (llama-cli), a source tree nor a git directory")


def archive(git_dir: Path, out: Path) -> None:
    """HEAD's files into `out`, without the test vocabularies a partial mirror may lack (the build needs none)."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as tar:
        subprocess.run(["git", "--git-dir", str(git_dir), "archive", "HEAD", "--", ".", ":(exclude)models/*.gguf",
                        ":(exclude)media", ":(exclude)figures"], stdout=tar, check=True)
        tar.seek(0)
        with tarfile.open(fileobj=tar) as t:
            t.extractall(out, filter="data")


def build(src: Path) -> Path:
    if not (src / "llama-cli").is_file():
        if not Path("/usr/include/zmq.h").is_file() and not Path("/usr/local/include/zmq.h").is_file():
            raise PrimaCppMissing("prima.cpp needs ZeroMQ's headers: apt-get install libzmq3-dev")
        print(f"building prima.cpp's llama-cli in {src} (make, ~15 minutes on 2 cores) ...", flush=True)
        with open(src / "build.log", "w") as log:
            done = subprocess.run(["make", f"-j{os.cpu_count() or 1}", "llama-cli"], cwd=src, stdout=log,
                                  stderr=subprocess.STDOUT)
        if done.returncode:
            raise PrimaCppMissing(f"prima.cpp did not build (see {src / 'build.log'})")
    return src / "llama-cli"


def ring_script(llama_cli: Path, gguf: Path, windows: list[int], tokens: int, threads: int) -> str:
    """Shell lines that run every rank on the namespace's loopback; rank 0's output is the script's."""
    common = f"'{llama_cli}' -m '{gguf}' --world {len(windows)} --master 127.0.0.1 --next 127.0.0.1 -t {threads}"
    lines = ["ip link set lo up"]
    lines += [f"{common} --rank {r} >/dev/null 2>&1 &" for r in range(1, len(windows))]
    lines.append(f"{common} --rank 0 -lw {','.join(map(str, windows))} -c 512 -n {tokens} --temp 0 --ignore-eos "
                 f"-p '{PROMPT}' 2>&1")
    lines.append("wait")
    return "\n".join(lines)


def ring_tpot(llama_cli: Path, gguf: Path, windows: list[int], tokens: int, threads: int = 1,
              timeout: float = 300) -> float:
    """ms per decode token (llama.cpp's own eval timer) of a prima.cpp ring, one process per rank."""
    unshare = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-rn"]
    done = subprocess.run([*unshare, "sh", "-c", ring_script(llama_cli, gguf, windows, tokens, threads)],
                          capture_output=True, text=True, timeout=timeout)
    m = EVAL.search(done.stdout)
    if m is None:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        raise PrimaCppMissing(f"prima.cpp's ring gave no timings (status {done.returncode}): {tail}")
    return float(m.group(1)) / int(m.group(2))
