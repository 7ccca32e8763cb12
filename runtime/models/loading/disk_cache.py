"""tandem's on-disk cache: where it lives, and entries written atomically with a manifest.

Where: $TANDEM_CACHE_DIR, else $XDG_CACHE_HOME/tandem, else ~/.cache/tandem. An entry is a
directory built in a temporary sibling and renamed into place, with a manifest of its files and
their sizes written last (`publish`): readers never see half an entry (`is_complete`), a writer
killed mid-way leaves only a temporary that a later writer removes once it is an hour old, and
a broken entry is renamed aside before it is deleted (`discard`). Used by the GGUF conversion
cache (gguf_cache) and the portable configs (portable_config).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

CACHE_DIR_ENV = "TANDEM_CACHE_DIR"
MANIFEST = ".manifest.json"  # written last: {file: size}
STALE_TMP_S = 3600.0  # a temporary this old belongs to a writer that died


def cache_root() -> Path:
    """$TANDEM_CACHE_DIR, else $XDG_CACHE_HOME/tandem, else ~/.cache/tandem."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tandem"


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def is_complete(target: Path) -> bool:
    """Whether `target` is a whole entry: its manifest is there and every file it lists has
    the listed size."""
    try:
        sizes = json.loads((target / MANIFEST).read_text())
        return (
            isinstance(sizes, dict)
            and bool(sizes)
            and all((target / name).stat().st_size == size for name, size in sizes.items())
        )
    except (OSError, ValueError, TypeError):
        return False


def discard(target: Path) -> None:
    """Remove an entry: renamed aside first, so no reader ever sees it half deleted."""
    trash = target.parent / f".{target.name}.trash-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(target, trash)
    except OSError:
        return  # gone already (another process discarded it)
    shutil.rmtree(trash, ignore_errors=True)


def _remove_stale(target: Path) -> None:
    """Temporaries of `target` left by writers that died (older than STALE_TMP_S)."""
    now = time.time()
    for tmp in target.parent.glob(f".{target.name}.*-*"):
        try:
            if now - tmp.stat().st_mtime > STALE_TMP_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def publish(target: Path, write: Callable[[Path], object]) -> None:
    """Build an entry with `write(tmp_dir)` in a temporary sibling of `target`, add the
    manifest, rename it into place. Another process that published first wins; ours goes."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(target)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        sizes = {
            str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()
        }
        (tmp / MANIFEST).write_text(json.dumps(sizes))
        for _ in range(2):
            try:
                os.rename(tmp, target)
                return
            except OSError:
                if is_complete(target):
                    return  # a concurrent writer was first: its entry is as good
                discard(target)  # a broken entry in the way
        raise OSError(f"cannot move the new cache entry into {target}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
