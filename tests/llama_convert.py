"""llama.cpp's own HF-to-GGUF converter, fetched once from the llama-cpp-python source package and run as a
subprocess (its gguf-py on PYTHONPATH), so that GGUF tests read files written the way users' files are. The first use
downloads the source package (and what pip needs to read it): a test that uses this module is marked slow, so that
`make test-fast` downloads nothing."""

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from prima_rpc.spec.home import prima_home

VERSION = "0.3.36"
PREFIX = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")  # the converter, its model classes, its gguf package


def source_package() -> Path:
    """llama-cpp-python's source package (llama.cpp inside), downloaded on first use; the test skips without it."""
    sdist = prima_home() / "llama-convert" / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                              f"llama-cpp-python=={VERSION}", "-d", str(sdist.parent)], capture_output=True, text=True)
        if got.returncode or not sdist.is_file():
            pytest.skip(f"cannot download llama-cpp-python {VERSION} for llama.cpp's converter: "
                        f"{(got.stderr or got.stdout).strip().splitlines()[-1:]}")
    return sdist


def chat_template(name: str) -> str:
    """A model family's own chat template as llama.cpp keeps it for its tests (models/templates/NAME)."""
    with tarfile.open(source_package()) as tar:
        return tar.extractfile(f"{PREFIX}models/templates/{name}").read().decode()


def converter_dir() -> Path:
    """The extracted vendor/llama.cpp (converter and gguf-py only), downloaded on first use."""
    cache = prima_home() / "llama-convert" / VERSION
    if (cache / "convert_hf_to_gguf.py").is_file():
        return cache
    sdist = source_package()
    tmp = cache.with_name(f".{cache.name}.partial-{os.getpid()}")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith(PREFIX) and m.name[len(PREFIX):].startswith(KEEP)]
        for m in members:
            m.name = m.name[len(PREFIX):]
        tar.extractall(tmp, members=members, filter="data")
    try:
        tmp.rename(cache)
    except OSError:  # another test process extracted it first (xdist workers, parallel CI jobs)
        if not (cache / "convert_hf_to_gguf.py").is_file():
            raise
        shutil.rmtree(tmp)
    return cache


def convert(hf_dir: Path, out: Path, outtype: str = "f32", vocab_only: bool = False) -> Path:
    """hf_dir as a GGUF file `out` written by llama.cpp's convert_hf_to_gguf.py (vocab_only: no tensors)."""
    conv = converter_dir()
    env = dict(os.environ, PYTHONPATH=str(conv / "gguf-py"), NO_LOCAL_GGUF="1")
    args = [str(hf_dir), "--outfile", str(out), "--outtype", outtype, *(["--vocab-only"] if vocab_only else [])]
    got = subprocess.run([sys.executable, str(conv / "convert_hf_to_gguf.py"), *args], capture_output=True, text=True,
                         env=env, cwd=conv)
    assert got.returncode == 0, f"convert_hf_to_gguf.py failed:\n{got.stderr[-3000:]}"
    return out
