"""What a prepared entry's shard entries name, and how a reuse checks it (no torch).

Every string in a shard entry of index.json names a file of the entry (`file`: the tokens;
data=chat's `mask` and `lengths` beside it; any later one), and each must be a plain name
inside the entry's folder: no folder part, no `..`, no symlink. `sha256` maps each of those
names to its digest, taken when the entry was prepared.

A shared cache is written by its users (the cache root with group write, the entries
with each user's umask), so a reuse believes nothing it has not checked: every listed file
is hashed and compared with the entry's digests the first time this user reuses it, and
again whenever a file's size, mtime, ctime or inode changed since (a write in place or a
replaced file changes one of them; ctime cannot be set back without root). What this user
verified or prepared is remembered per user (~/.cache/launcher/verified-shards.json, never
in the shared cache), digests included: an index.json whose digests were rewritten along
with its shards no longer matches what this user recorded. An entry without digests (an
earlier version wrote it) is prepared again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from launcher.config import ConfigError
from launcher.data.units import write_json_atomic


class NotItsOwn(ConfigError):
    """index.json names a file that is not the entry's own: refused, never prepared over."""


PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
DIGESTS = "sha256"
MEMO = "verified-shards.json"


def names(entry: dict) -> list[str]:
    """The files one shard entry lists: every string value in it."""
    return [v for v in entry.values() if isinstance(v, str)]


def bad_name(folder: Path, entry: dict) -> str | None:
    """What is wrong with the names `entry` lists (one line's words), None when each is a plain
    name of a regular file, not a symlink, inside `folder`."""
    for name in names(entry):
        if not PLAIN.fullmatch(name):
            return f"names {name!r}, not a plain file name inside {folder} (a shard entry names its own files only)"
        if (folder / name).is_symlink():
            return f"names {name}, a symlink (a shard entry's files are its own, never links)"
    return None


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return file_sha256(f)


def file_sha256(f) -> str:
    """An open binary file's sha256. hashlib lets go of the GIL (file_digest, or update on
    large chunks): threads hash at once. file_digest is Python 3.11's; 3.10 reads in chunks."""
    if sys.version_info >= (3, 11):
        return hashlib.file_digest(f, "sha256").hexdigest()
    h = hashlib.sha256()
    while chunk := f.read(1 << 20):
        h.update(chunk)
    return h.hexdigest()


def _stamp(path: Path) -> list[int]:
    s = path.stat()
    return [s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino]


def memo_path() -> Path:
    return Path(os.path.expanduser("~/.cache/launcher")) / MEMO


def _memo() -> dict:
    try:
        data = json.loads(memo_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _remember(found: dict[str, str]) -> None:
    """Record each path's stamp and digest in this user's memo (best effort: a read-only
    home only means hashing again next time)."""
    memo = _memo()
    for path, digest in found.items():
        memo[path] = {"stamp": _stamp(Path(path)), "sha256": digest}
    try:
        memo_path().parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(memo_path(), memo)
    except OSError:
        pass


def with_digests(folder: Path, entries: list[dict], threads: int) -> list[dict]:
    """The shard entries with `sha256`: each listed file hashed (`threads` at once), and
    remembered as this user's (prepared here)."""
    paths = [str(folder / n) for e in entries for n in names(e)]
    with ThreadPoolExecutor(max(1, threads)) as pool:
        found = dict(zip(paths, pool.map(lambda p: _sha256(Path(p)), paths)))
    _remember(found)
    return [{**e, DIGESTS: {n: found[str(folder / n)] for n in names(e)}} for e in entries]


def unverified(folder: Path, entries: list, threads: int) -> str | None:
    """Why the entry's files cannot be believed (one line's words), None when each listed
    file has the digest the entry records: from this user's memo where the file is unchanged
    since and the memo agrees with index.json, else hashed now (and remembered)."""
    memo, todo = _memo(), []
    for e in entries:
        recorded = e.get(DIGESTS) if isinstance(e, dict) else None
        if not isinstance(recorded, dict) or set(recorded) != set(names(e)):
            return "its index.json records no digest for each file (an earlier version wrote it)"
        for name, digest in recorded.items():
            path = str(folder / name)
            known = memo.get(path)
            if isinstance(known, dict) and known.get("sha256") != digest:  # one key, one content: never two digests
                return f"its index.json gives {name} another digest than the one this user prepared or verified"
            if not isinstance(known, dict) or known.get("stamp") != _stamp(folder / name):
                todo.append((path, digest))
    with ThreadPoolExecutor(max(1, threads)) as pool:
        got = list(pool.map(lambda t: _sha256(Path(t[0])), todo))
    for (path, digest), actual in zip(todo, got):
        if actual != digest:
            return f"{Path(path).name} fails its sha256 (changed since it was prepared)"
    _remember({p: d for (p, _), d in zip(todo, got)})
    return None
