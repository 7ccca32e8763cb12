"""runtime.models.loading.gguf_cache: a GGUF converted once (config, metadata, dequantized weights),
then read from the cache; bit-identical to reading the GGUF, entries atomic and rebuilt when
broken, a cache that cannot be written never fatal."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from runtime.models import load_model
from runtime.models.loading import checkpoint, disk_cache, gguf_cache, weights
from tests.checkpoints import smollm2_gguf
from tests.model_helpers import extend

pytestmark = pytest.mark.timeout(300)

F32 = torch.float32
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 11173, 30, 216, 504, 3458]


class GGUFReads:
    """Counts what costs seconds in a GGUF: parses of the file (GGUFReader, also behind
    transformers' config reader) and tensors dequantized (GGUFWeights.get)."""

    def __init__(self, monkeypatch):
        from gguf import GGUFReader

        self.parses = self.dequantized = 0
        reader_init, get = GGUFReader.__init__, weights.GGUFWeights.get

        def counting_init(reader, *args, **kwargs):
            self.parses += 1
            reader_init(reader, *args, **kwargs)

        def counting_get(source, name):
            self.dequantized += 1
            return get(source, name)

        monkeypatch.setattr(GGUFReader, "__init__", counting_init)
        monkeypatch.setattr(weights.GGUFWeights, "get", counting_get)


def _fresh_process() -> None:
    """Forget the in-process memo of checkpoint metadata, as a new process would."""
    checkpoint._inspect_gguf_cached.cache_clear()
    checkpoint._inspect_gguf.cache_clear()


def _logits(model) -> torch.Tensor:
    model.allocate_cache(1, 32)
    with torch.no_grad():
        return extend(model, 0, 0, PROMPT)


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    """The SmolLM2 GGUF loaded three ways: straight from the GGUF (weights cache off, a
    cache of its own), on a first start (cache empty: converted, then read from the cache)
    and a second start; with the GGUF reads each one made."""
    cache = tmp_path_factory.mktemp("gguf-cache")
    path = smollm2_gguf()
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        for name, max_gb in (("direct", "0"), ("first", None), ("second", None)):
            mp.setenv(
                disk_cache.CACHE_DIR_ENV,
                str(tmp_path_factory.mktemp("direct") if max_gb else cache),
            )
            if max_gb is None:
                mp.delenv(gguf_cache.MAX_GB_ENV, raising=False)
            else:
                mp.setenv(gguf_cache.MAX_GB_ENV, max_gb)
            with pytest.MonkeyPatch.context() as spy:
                reads = GGUFReads(spy)
                _fresh_process()
                info = checkpoint.inspect_checkpoint(path)
                model = load_model(path, F32, "cpu")
            out[name] = {
                "model": model,
                "reads": reads,
                "info": info,
                "logits": _logits(model),
                "cache": disk_cache.cache_root(),
            }
    _fresh_process()
    return cache, out


def test_the_second_start_reads_nothing_from_the_gguf(loads):
    _, out = loads
    assert out["first"]["reads"].dequantized == 272  # every tensor, once
    assert out["first"]["reads"].parses >= 3  # metadata, config, weights
    assert out["second"]["reads"].parses == 0
    assert out["second"]["reads"].dequantized == 0
    assert isinstance(out["direct"]["model"], type(out["second"]["model"]))
    assert out["direct"]["reads"].dequantized == 272  # the weights cache was off
    assert not list(out["direct"]["cache"].glob("gguf/*/*/weights-*"))


def test_cached_model_is_bit_identical(loads):
    _, out = loads
    direct = out["direct"]["model"].state_dict()
    for name in ("first", "second"):
        got = out[name]["model"].state_dict()
        assert got.keys() == direct.keys()
        for key, tensor in direct.items():
            assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
        assert torch.equal(out[name]["logits"], out["direct"]["logits"])
        assert out[name]["info"] == out["direct"]["info"]
        assert out[name]["model"].args == out["direct"]["model"].args


def test_the_cached_config_equals_the_ggufs(loads, monkeypatch):
    import transformers

    path = Path(smollm2_gguf())
    monkeypatch.setenv(disk_cache.CACHE_DIR_ENV, str(loads[0]))
    cached = gguf_cache.load_config(path)
    read = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    assert cached.to_dict() == read.to_dict()


def test_weights_over_the_size_limit_are_not_cached(loads, monkeypatch, tmp_path):
    from runtime.models.loading.loader import build_model

    path = Path(smollm2_gguf())
    # a cache holding what the module's first start converted but its weights: the config
    # comes from there (not a parse of the GGUF's metadata again); the weights are the test's
    shutil.copytree(
        loads[0], tmp_path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("weights-*")
    )
    assert not list(tmp_path.glob("gguf/*/*/weights-*"))
    monkeypatch.setenv(disk_cache.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(gguf_cache.MAX_GB_ENV, "0.1")  # 100 MB < 538 MB of float32
    config = gguf_cache.load_config(path)
    model = build_model(config)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    source = gguf_cache.open_weights(path, config, names)
    assert isinstance(source, weights.GGUFWeights)
    assert source.dequantized_nbytes() == 538_060_032
    assert not list(tmp_path.glob("gguf/*/*/weights-*"))
    source.close()


def test_entry_layout(loads):
    cache, _ = loads
    path = smollm2_gguf()
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    (entry,) = (cache / "gguf" / digest).iterdir()
    assert entry.name == gguf_cache.converter_tag()
    names = {p.name for p in entry.iterdir()}
    assert {"config", "info"} <= names
    (weights_dir,) = [entry / n for n in names if n.startswith("weights-")]
    assert disk_cache.is_complete(weights_dir)
    index = json.loads((weights_dir / weights.INDEX_FILE).read_text())
    assert len(index["weight_map"]) == 272
    assert not [p for p in entry.iterdir() if ".tmp-" in p.name]  # no temporaries left


# --- the cache's mechanics, on small files -------------------------------------------------
@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(disk_cache.CACHE_DIR_ENV, str(root))
    return root


@pytest.fixture()
def source(tmp_path) -> Path:
    """A file standing in for a GGUF: the cache keys on its bytes only."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not really a gguf, but bytes to hash" * 100)
    return path


class Built:
    """make/save/load for gguf_cache.cached, counting the builds."""

    def __init__(self, text: str = "converted"):
        self.text, self.made = text, 0

    def make(self) -> str:
        self.made += 1
        return self.text

    @staticmethod
    def save(text: str, tmp: Path) -> None:
        (tmp / "value.txt").write_text(text)

    @staticmethod
    def load(directory: Path) -> str:
        text = (directory / "value.txt").read_text()
        if not text.startswith("converted"):
            raise ValueError(f"garbage: {text!r}")
        return text


def _cached(source: Path, built: Built) -> str:
    return gguf_cache.cached(source, "thing", built.make, built.save, built.load)


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.delenv(disk_cache.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert disk_cache.cache_root() == tmp_path / "xdg" / "tandem"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert disk_cache.cache_root() == tmp_path / "home" / ".cache" / "tandem"
    monkeypatch.setenv(disk_cache.CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert disk_cache.cache_root() == tmp_path / "mine"


def test_built_once_then_read(cache, source):
    built = Built()
    assert _cached(source, built) == "converted"
    assert _cached(source, built) == "converted"
    assert built.made == 1
    target = gguf_cache.entry_dir(source) / "thing"
    assert disk_cache.is_complete(target)


def test_the_digest_is_the_files_and_follows_its_bytes(cache, source):
    want = hashlib.sha256(source.read_bytes()).hexdigest()
    assert gguf_cache.file_sha256(source) == want
    assert len(list((cache / "digests").iterdir())) == 1  # remembered
    st = source.stat()
    data = bytearray(source.read_bytes())
    data[0] ^= 1  # same size, and the mtime put back
    source.write_bytes(bytes(data))
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert gguf_cache.file_sha256(source) == hashlib.sha256(bytes(data)).hexdigest()
    built = Built()
    _cached(source, built)
    _cached(source, built)
    assert built.made == 1


def test_a_truncated_entry_is_rebuilt(cache, source):
    built = Built()
    _cached(source, built)
    target = gguf_cache.entry_dir(source) / "thing"
    (target / "value.txt").write_text("conv")  # cut short: not the manifest's size
    assert not disk_cache.is_complete(target)
    assert _cached(source, built) == "converted"
    assert built.made == 2
    assert disk_cache.is_complete(target)


def test_an_entry_that_fails_to_load_is_rebuilt(cache, source):
    built = Built()
    _cached(source, built)
    target = gguf_cache.entry_dir(source) / "thing"
    (target / "value.txt").write_text("garbage!!")  # the manifest's size, wrong bytes
    assert disk_cache.is_complete(target)
    assert _cached(source, built) == "converted"
    assert built.made == 2
    assert (target / "value.txt").read_text() == "converted"


def test_a_killed_writer_leaves_no_entry(cache, source):
    """What a writer killed mid-way leaves (a temporary) is no entry; a later writer removes
    it once an hour old, and leaves a younger one (a live writer's) alone."""
    parent = gguf_cache.entry_dir(source)
    dead, live = parent / ".thing.tmp-999-dead", parent / ".thing.tmp-998-live"
    for tmp in (dead, live):
        tmp.mkdir(parents=True)
        (tmp / "value.txt").write_text("conv")
    os.utime(dead, (0, 0))
    built = Built()
    assert _cached(source, built) == "converted" and built.made == 1
    assert not dead.exists() and live.exists()


def test_concurrent_writers(cache, source):
    """Many threads build the same entry at once: every one gets the value, one entry
    stays, no temporary is left."""
    results, start = [], threading.Barrier(6)

    def build() -> None:
        built = Built()
        start.wait()
        results.append(_cached(source, built))

    threads = [threading.Thread(target=build) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == ["converted"] * 6
    parent = gguf_cache.entry_dir(source)
    assert [p.name for p in parent.iterdir()] == ["thing"]
    assert disk_cache.is_complete(parent / "thing")


def test_an_unusable_cache_is_no_error(tmp_path, monkeypatch, source, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(disk_cache.CACHE_DIR_ENV, str(blocker / "cache"))  # cannot exist
    built = Built()
    with caplog.at_level("WARNING", logger="tandem.cache"):
        assert _cached(source, built) == "converted"
        assert _cached(source, built) == "converted"
    assert built.made == 2
    assert "cannot" in caplog.text


def test_make_errors_are_the_callers(cache, source):
    def make():
        raise ValueError("not a GGUF")

    with pytest.raises(ValueError, match="not a GGUF"):
        gguf_cache.cached(source, "thing", make, Built.save, Built.load)
    assert not (gguf_cache.entry_dir(source) / "thing").exists()


def test_bad_max_gb(monkeypatch):
    monkeypatch.setenv(gguf_cache.MAX_GB_ENV, "lots")
    with pytest.raises(ValueError, match=gguf_cache.MAX_GB_ENV):
        gguf_cache.open_weights("x.gguf", None, [])
