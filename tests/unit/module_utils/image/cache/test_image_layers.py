"""module_utils/image/cache/layers.py's pure parts on a `docker save`-shaped tar made here: chain IDs, the index,
which layers a daemon lacks, and the delta with its per-layer check. Loading real deltas into real daemons:
tests/unit/module_utils/image/cache/test_image_cache.py."""

import hashlib
import io
import json
import tarfile

import pytest

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import ImageCacheError
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.layers import (
    SavedImage,
    chain_ids,
    write_delta,
)


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def saved_tar(path, layers, diff_ids=None):
    """A docker-save-shaped tar of `layers` (bytes each); returns the image ID (its config's digest)."""
    config = json.dumps({"rootfs": {"type": "layers", "diff_ids": diff_ids or [_digest(x) for x in layers]}}).encode()
    image_id = _digest(config)
    files = [(f"layer{i}/layer.tar", data) for i, data in enumerate(layers)]
    manifest = [{"Config": image_id[7:] + ".json", "RepoTags": ["m:1"], "Layers": [name for name, _ in files]}]
    with tarfile.open(path, "w") as tar:
        for name, data in [*files, (image_id[7:] + ".json", config), ("manifest.json", json.dumps(manifest).encode())]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return image_id


class FakeLoad:
    def __init__(self):
        self.data = bytearray()
        self.aborted = False

    def feed(self, chunk):
        self.data += chunk

    def abort(self):
        self.aborted = True


def test_a_chain_id_covers_the_layer_and_every_layer_under_it():
    assert chain_ids(["sha256:a"]) == ["sha256:a"]
    second = "sha256:" + hashlib.sha256(b"sha256:a sha256:b").hexdigest()
    assert chain_ids(["sha256:a", "sha256:b"]) == ["sha256:a", second]
    assert chain_ids(["sha256:b", "sha256:a"])[1] != second  # the same layers in another order: another chain


def test_a_daemon_holding_the_base_lacks_only_the_layers_above_it(tmp_path):
    base, model = b"base" * 1000, b"model"
    image_id = saved_tar(tmp_path / "e.tar", [base, model])
    with open(tmp_path / "e.tar", "rb") as source:
        saved = SavedImage(source, image_id)
        chains = chain_ids([_digest(base), _digest(model)])
        assert _named(saved.delta_parts({chains[0]})) == [("layer1/layer.tar", _digest(model))]
        assert _named(saved.delta_parts(set())) == list(zip(saved.layer_files, saved.diff_ids, strict=True))
        assert saved.delta_parts(set(chains)) == []
        # The model's layer alone, over another base: a chain of its own, so everything is lacking.
        assert len(saved.delta_parts({_digest(model)})) == 2


def _named(parts):
    return [(part.name, part.digest) for part in parts]


def test_the_delta_holds_the_config_the_lacking_layers_and_the_manifest_last(tmp_path):
    base, model = b"base" * 1000, b"model"
    image_id = saved_tar(tmp_path / "e.tar", [base, model])
    load = FakeLoad()
    with open(tmp_path / "e.tar", "rb") as source:
        saved = SavedImage(source, image_id)
        read = write_delta(saved.config_name, saved.config, saved.manifest, saved.delta_parts({_digest(base)}), load)
    assert read == len(model) and not load.aborted
    with tarfile.open(fileobj=io.BytesIO(bytes(load.data))) as delta:
        names = delta.getnames()
        assert names == [image_id[7:] + ".json", "layer1/layer.tar", "manifest.json"]
        assert delta.extractfile("layer1/layer.tar").read() == model
        assert json.loads(delta.extractfile("manifest.json").read())[0]["Layers"] == saved.layer_files


def test_a_layer_that_does_not_hash_to_its_diff_id_aborts_the_load(tmp_path):
    base, model = b"base" * 1000, b"model"
    image_id = saved_tar(tmp_path / "e.tar", [base, model], diff_ids=[_digest(base), _digest(b"other")])
    load = FakeLoad()
    with open(tmp_path / "e.tar", "rb") as source:
        saved = SavedImage(source, image_id)
        with pytest.raises(ImageCacheError, match="layer file layer1/layer.tar does not hash to sha256:"):
            write_delta(saved.config_name, saved.config, saved.manifest, saved.delta_parts({_digest(base)}), load)
    assert load.aborted and b"manifest.json" not in bytes(load.data)


def test_an_entry_of_another_image_is_refused_by_its_config(tmp_path):
    saved_tar(tmp_path / "e.tar", [b"x"])
    with open(tmp_path / "e.tar", "rb") as source, pytest.raises(ImageCacheError, match="not the one of image"):
        SavedImage(source, "sha256:" + "0" * 64)


def test_a_manifest_and_config_that_disagree_on_the_layers_are_refused(tmp_path):
    image_id = saved_tar(tmp_path / "e.tar", [b"x"], diff_ids=[_digest(b"x"), _digest(b"y")])
    with (
        open(tmp_path / "e.tar", "rb") as source,
        pytest.raises(ImageCacheError, match="1 layer files and its config 2"),
    ):
        SavedImage(source, image_id)
