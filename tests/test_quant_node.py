"""A running prima-node on an int4 store with a bad unit file: when no ring member has a good copy, Assign answers
with one line naming the file, the node stays up (Info answers), and once the file is fixed the same node assigns;
when the head has a good copy, the node fetches it (weights travel over the ring) and assigns."""

import json
import os
import shutil
from pathlib import Path

import pytest

from prima_rpc.app import ring
from tests.rings import local_ring
from tools.synth import synth

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_int4(tmp_path_factory) -> Path:
    return synth(tmp_path_factory.mktemp("stores") / "tiny-int4", "tiny", seed=3, dtype="int4")


def linked_copy(store: Path, to: Path, own: tuple[str, ...]) -> Path:
    """`store` as hard links, except the files in `own`, which are copies this test may damage."""
    to.mkdir()
    for f in store.iterdir():
        if f.name in own:
            shutil.copyfile(f, to / f.name)
        else:
            os.link(f, to / f.name)
    return to


def own_caches(tmp_path: Path, n: int) -> list[list[str]]:
    """Each node its own fetch cache: $PRIMA_HOME/cache outlives the test and would supply a good copy."""
    return [["--cache", str(tmp_path / f"cache{i}")] for i in range(n)]


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def sizes_match_the_truncated_file(store: Path) -> None:
    """The manifest says the truncated file's size (and no hash): the tensors' sizes still do not fit."""
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["files"]["layers"][1]["bytes"] = (store / "layer_001.safetensors").stat().st_size
    manifest["files"]["layers"][1]["sha256"] = ""
    (store / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage, error", [
    ("truncated", r"layer_001\.safetensors"),
    ("sizes", r"layer_001\.safetensors"),
])
def test_a_bad_int4_unit_is_named_and_the_node_stays_up(tiny_int4, tmp_path, damage, error):
    broken = linked_copy(tiny_int4, tmp_path / "broken", ("layer_001.safetensors", "manifest.json"))
    good = (tiny_int4 / "layer_001.safetensors").read_bytes()
    truncate(broken / "layer_001.safetensors")
    if damage == "sizes":
        sizes_match_the_truncated_file(broken)
    # Both nodes hold the broken store, so no member can send node1 a good copy of the unit.
    with local_ring(None, 2, tmp_path, models=[broken, broken], extra_args=own_caches(tmp_path, 2)) as local:
        with pytest.raises(ring.RingError, match=error) as err:
            ring.start(local.addresses[0], [4, 4])  # node1 would hold [0, 4)
        assert "\n" not in str(err.value).strip()
        assert local.processes[1].poll() is None
        info = ring.walk(local.addresses[1])[0][1]
        assert "layer_001.safetensors" in info.error and not info.loaded

        if damage == "sizes":
            return  # the node read this manifest when it started: fixing it takes a restart
        (broken / "layer_001.safetensors").write_bytes(good)  # fixed: the same node now assigns
        ring.start(local.addresses[0], [4, 4])
        infos = ring.walk(local.addresses[0])
        assert [info.loaded for _, info in infos] == [True, True], [(i.loaded, i.error, i.state) for _, i in infos]


def test_a_truncated_int4_unit_is_fetched_again_from_the_head(tiny_int4, tmp_path):
    broken = linked_copy(tiny_int4, tmp_path / "broken", ("layer_001.safetensors",))
    truncate(broken / "layer_001.safetensors")
    # node1 holds [0, 4): its layer 1 comes from the head
    with local_ring(None, 2, tmp_path, [4, 4], models=[tiny_int4, broken], extra_args=own_caches(tmp_path, 2)) as local:
        infos = ring.walk(local.addresses[0])
        assert [info.loaded for _, info in infos] == [True, True], [(i.loaded, i.error) for _, i in infos]
        assert infos[1][1].fetched_bytes > 0
