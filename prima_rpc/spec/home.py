"""The home folder: where every part keeps its stores, caches, profiles and run records ($PRIMA_HOME)."""

import os
from pathlib import Path


def prima_home() -> Path:
    return Path(os.environ.get("PRIMA_HOME", Path.home() / ".cache" / "prima"))
