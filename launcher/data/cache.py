"""The shared cache of prepared data: one directory per content key, made once.

    <cache_dir>/<key>/index.json                         written last: the directory is prepared
    <cache_dir>/<key>/shard_000000.bin, shard_000001.bin  flat little-endian tokens of `dtype`, no header
    <cache_dir>/<key>.lock                               held while the key is being prepared
    <cache_dir>/digests.json                             sha256 per (path, size, mtime_ns): a relaunch rehashes nothing

index.json = {"format": "launcher-tokens", "version": 1, "dtype": "uint16"|"uint32",
"tokens", "documents", "shards": [{"file", "tokens", "documents", "sha256": {file: digest}}, ...]
(in order; every file a shard entry names is checked at each reuse: launcher/data/shards.py),
"tokenizer" (its identity), "tokenizer_spec" (data.tokenizer as given), "vocab_size",
"eos_id", "text_field", "source_format", "sources": [{"path", "bytes", "sha256"}, ...]}.
data=chat adds a mask and a lengths file beside each shard (launcher/data/chat_units.py),
named in its entry ("mask", "lengths"), and "kind": "chat", the template's sha256,
train_on, the messages field and "counted" (the tokens that count in the loss).

The key covers the files' contents (their sha256, in order), the format, the field, the
tokenizer's identity and its end-of-document token (data=chat: and the template's text, train_on and
the messages field): every run and sweep point with the
same inputs reads the same directory, wherever the files lie. Not train.seq_len: windows
are cut when the ranks read.

A pool of data.num_proc processes tokenizes the work units (launcher/data/units.py); each
unit writes one shard and then its record (unit_<k>.json), both renamed into place, so a
killed preparation leaves whole shards only, and the next launch with the same inputs
does the units without a record. index.json is written last, then the records go. A
second launch of the same key waits on the lock, then reuses the directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import multiprocessing as mp
import os
import queue as queues
import shutil
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from launcher.config import Config, ConfigError, DataConfig, DataKind, TextFormat
from launcher.data import chat_units, shards, units
from launcher.data.chat import settings as chat_settings
from launcher.data.inputs import file_format, load_tokenizer, resolve_files, token_dtype
from launcher.data.progress import Meter, count
from launcher.data.sources import indexed
from launcher.host import usable_cores
from launcher.manifest import _fsync_dir

INDEX = "index.json"
PLAN = "plan.json"
DIGESTS = "digests.json"
FORMAT = "launcher-tokens"
VERSION = 1
ENV = "LAUNCHER_DATA_CACHE"
LOUD_HASH = 1 << 30
"""Above this many bytes to hash, a line says the launch is hashing."""


def processes(d: DataConfig) -> int:
    return d.num_proc or usable_cores()


def cache_root(d: DataConfig) -> Path:
    """data.cache_dir, else $LAUNCHER_DATA_CACHE, else ~/.cache/launcher/data; absolute."""
    where = d.cache_dir or os.environ.get(ENV) or "~/.cache/launcher/data"
    return Path(os.path.expanduser(str(where))).resolve()


class InputError(ConfigError):
    """A file a worker cannot read or tokenize: its key never completes (the contents are
    the key), so what was made of it goes."""


@dataclass
class Prepared:
    dir: Path
    index: dict
    reused: bool
    seconds: float = 0.0
    processes: int = 0
    units: int = 0
    resumed: int = 0
    """Units an earlier, interrupted launch had done."""
    built_bytes: int = 0
    built_tokens: int = 0


def describe(got: Prepared) -> str:
    if got.reused:
        return f"prepared data {got.dir} reused"
    if not got.processes:  # killed after its last unit, before index.json
        return f"prepared data {got.dir} finished in {got.seconds:.1f} s: all {got.units} units were done by an earlier launch"
    rate = (
        f" ({count(got.built_bytes / got.seconds)}B/s, {count(got.built_tokens / got.seconds)} tokens/s)"
        if got.seconds > 0 and got.built_bytes
        else ""
    )
    resumed = f"; {got.resumed} of {got.units} units were done by an earlier launch" if got.resumed else ""
    return (
        f"prepared data {got.dir} built in {got.seconds:.1f} s by {got.processes} "
        f"process{'es' if got.processes != 1 else ''}{rate}{resumed}"
    )


@contextlib.contextmanager
def locked(path: Path, waiting=None):
    """An exclusive flock on `path` (made if missing); `waiting()` is called when another
    process holds it. Yields the descriptor."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- the key
def _sha256(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            return shards.file_sha256(f)  # hashlib lets go of the GIL: threads hash in parallel
    except OSError as err:
        raise ConfigError("data.files", str(path), f"cannot be read ({err.strerror or err})") from err


def digests(root: Path, files: list[Path], threads: int, out=None) -> tuple[list[str], int]:
    """Each file's sha256, from <root>/digests.json where its path, size and mtime match,
    else hashed (by `threads` threads) and remembered. Returns them and the bytes hashed."""
    memo_path = root / DIGESTS

    def memo() -> dict:
        try:
            return json.loads(memo_path.read_text()).get("files", {})
        except (OSError, ValueError, AttributeError):  # none yet, or a torn file of an old version: rehash
            return {}

    stats = [f.stat() for f in files]
    known = memo()
    # size, mtime, ctime and inode: a rewrite in place, a copy with `cp -p` or `rsync -a` change one of them
    wanted = [(str(f), s.st_size, (s.st_mtime_ns, s.st_ctime_ns, s.st_ino)) for f, s in zip(files, stats)]
    found = {
        p: known[p]["sha256"]
        for p, size, stamp in wanted
        if isinstance(known.get(p), dict) and (known[p].get("size"), known[p].get("stamp")) == (size, list(stamp))
    }
    todo = [(p, size, stamp) for p, size, stamp in wanted if p not in found]
    hashed = sum(size for _, size, _ in todo)
    if todo:
        if hashed > LOUD_HASH:
            print(
                f"data: hashing {len(todo)} file(s), {count(hashed)}B, for the cache key (once: remembered in "
                f"{memo_path})",
                file=out or sys.stdout,
                flush=True,
            )
        with ThreadPoolExecutor(max(1, min(threads, len(todo)))) as pool:
            found.update(zip((p for p, _, _ in todo), pool.map(lambda t: _sha256(Path(t[0])), todo)))
        try:  # a read-only shared cache: the next launch hashes again, nothing worse
            with locked(root / f"{DIGESTS}.lock"):
                merged = memo()
                merged.update({p: {"size": size, "stamp": list(stamp), "sha256": found[p]} for p, size, stamp in todo})
                units.write_json_atomic(memo_path, {"version": VERSION, "files": merged})
        except OSError as err:
            print(
                f"data: could not remember the digests in {memo_path} ({err.strerror or err}); the next launch "
                "hashes these files again",
                file=out or sys.stdout,
                flush=True,
            )
    return [found[p] for p, _, _ in wanted], hashed


def cache_key(sums: list[str], fmt: str, field: str, tok, extra: dict | None = None) -> str:
    what = {
        "version": VERSION,
        "sources": sums,
        "format": fmt,
        "text_field": field,
        "tokenizer": tok.identity,
        "eos": int(tok.eos_id),
        **(extra or {}),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


# ----------------------------------------------------------------------------- preparing
def prepare(cfg: Config, unit_bytes: int | None = None, out=None) -> Prepared:
    """The prepared directory of cfg.data (made here if no launch made it before).
    `unit_bytes`: input bytes per work unit (default data.shard_mb MiB; tests make it small)."""
    out = out or sys.stdout
    d = cfg.data
    files = resolve_files(d)
    fmt = file_format(d, files)
    tok = load_tokenizer(d.tokenizer)
    chat = chat_settings(d, tok) if d.name == DataKind.chat else {"key": None, "job": {}}
    root = cache_root(d)
    try:
        root.mkdir(parents=True, exist_ok=True)
        nproc, t0 = processes(d), time.perf_counter()
        src = _Inputs(files, fmt, [f.stat() for f in files], digests(root, files, nproc, out)[0], tok, chat)
        folder = root / cache_key(src.sums, fmt.value, d.text_field, tok, chat["key"])
        if whole(folder, out, nproc):
            return Prepared(folder, json.loads((folder / INDEX).read_text()), reused=True)

        def waiting() -> None:
            print(
                f"data: another launch is preparing the same data into {folder}; waiting for it", file=out, flush=True
            )

        with locked(folder.with_name(folder.name + ".lock"), waiting) as fd:
            if whole(folder, out, nproc):  # made while this launch waited
                return Prepared(folder, json.loads((folder / INDEX).read_text()), reused=True)
            return _build(cfg, folder, src, fd, nproc, unit_bytes or d.shard_mb << 20, out, t0)
    except OSError as err:
        raise ConfigError(
            "data.cache_dir",
            str(root),
            f"the prepared data could not be written ({err}); "
            "choose another data.cache_dir, or free space (the units done so far are kept for the "
            "next launch)",
        ) from err


@dataclass
class _Inputs:
    """What one preparation reads: the files (their format, their stat and digests when
    hashed), the tokenizer, data=chat's settings."""

    files: list[Path]
    fmt: TextFormat
    stats: list[os.stat_result]
    sums: list[str]
    tok: object
    chat: dict


def _build(cfg: Config, folder: Path, src: _Inputs, fd: int, nproc: int, unit_bytes: int, out, t0: float) -> Prepared:
    """Under the key's lock: the units an earlier launch left kept, the others tokenized by
    `nproc` processes, then the index written last (what makes the folder whole)."""
    d, files = cfg.data, src.files
    folder.mkdir(exist_ok=True)
    for tmp in folder.glob(".*.tmp"):  # what a killed launch was writing: never renamed, never read
        tmp.unlink(missing_ok=True)
    sizes = [s.st_size for s in src.stats]  # what was hashed: the key's content
    plan = _plan(folder, files, src.fmt, sizes, unit_bytes)
    dtype = token_dtype(src.tok)
    done = _recorded(folder, len(plan), dtype.width)
    jobs = [
        {
            "unit": k,
            "dir": str(folder),
            "format": src.fmt.value,
            "field": d.text_field,
            "tokenizer": d.tokenizer,
            "dtype": dtype.value,
            "bytes": sum(map(units.piece_bytes, pieces)),
            "pieces": [{**p, "path": str(files[p["file"]])} for p in pieces],
            **src.chat["job"],
        }
        for k, pieces in enumerate(plan)
        if k not in done
    ]
    total = sum(units.piece_bytes(p) for pieces in plan for p in pieces)
    meter = Meter(total, total - sum(j["bytes"] for j in jobs), out)
    room(folder, sum(j["bytes"] for j in jobs), dtype.width, d.tokenizer == "byte", out)
    resumed = len(done)
    try:
        done.update(_run(jobs, nproc, fd, meter, chat_units.tokenize_chat_unit if src.chat["key"] else None))
    except InputError:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    _unchanged(folder, files, src.stats)
    index = _index(
        cfg, src.tok, dtype, src.fmt, files, sizes, src.sums, [done[k] for k in range(len(plan))], src.chat["key"]
    )
    index["shards"] = shards.with_digests(folder, index["shards"], nproc)  # checked at every reuse
    _fsync_dir(folder)  # every shard's and record's rename is on disk before the index says they are whole
    units.write_json_atomic(folder / INDEX, index)
    _fsync_dir(folder)
    _tidy(folder, index, len(plan))
    return Prepared(
        folder,
        index,
        reused=False,
        seconds=time.perf_counter() - t0,
        processes=min(nproc, len(jobs)),
        units=len(plan),
        resumed=resumed,
        built_bytes=meter.bytes,
        built_tokens=meter.tokens,
    )


def _unchanged(folder: Path, files: list[Path], stats: list[os.stat_result]) -> None:
    """What was read is what was hashed, else this key's content is not known: the folder goes."""
    changed = [
        str(f) for f, s in zip(files, stats) if (f.stat().st_size, f.stat().st_mtime_ns) != (s.st_size, s.st_mtime_ns)
    ]
    if changed:
        shutil.rmtree(folder, ignore_errors=True)
        raise ConfigError(
            "data.files", changed[0], "changed while it was prepared; launch again once the files stay as they are"
        )


def whole(folder: Path, out, threads: int = 1) -> bool:
    """A prepared directory whose index.json names shards that are all there, whole, with
    the digests it records (launcher/data/shards.py: hashed the first time this user reuses
    it, and after any change). A damaged one (a shard purged from scratch, cut short,
    rewritten) loses its index and is prepared again, in one line; a name that is not its
    own file (/etc/passwd, ../other/shard_000000.bin) is refused."""
    index = folder / INDEX
    if not index.is_file():
        return False
    try:
        indexed("data.files", str(folder), index)
        problem = shards.unverified(folder, json.loads(index.read_text())["shards"], threads)
    except shards.NotItsOwn:
        raise
    except ConfigError as err:
        problem = err.allowed
    if problem is None:
        return True
    print(f"data: {folder} is damaged ({problem}); preparing it again", file=out, flush=True)
    index.unlink(missing_ok=True)
    return False


def room(folder: Path, todo_bytes: int, width: int, byte_level: bool, out) -> None:
    """One line when the cache's filesystem looks too small for what is left to write:
    a byte-level tokenizer makes a token of every input byte, a subword one about one of
    every 3-4 (an estimate: the line warns, the write itself decides)."""
    need = todo_bytes * width // (1 if byte_level else 3)
    free = shutil.disk_usage(folder).free
    if need > free:
        print(
            f"data: about {count(need)}B of shards to write into {folder}, {count(free)}B free there; "
            "a full disk stops the preparation (the units done are kept)",
            file=out,
            flush=True,
        )


def _plan(folder: Path, files: list[Path], fmt, sizes: list[int], unit_bytes: int) -> list[list[dict]]:
    """The units of this key: those an earlier launch planned (whatever data.shard_mb says
    now: its records are for them), else planned here and saved before any unit runs."""
    path = folder / PLAN
    try:
        saved = json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        saved = None
    if saved and saved.get("version") == VERSION and saved.get("sizes") == sizes:
        return saved["units"]
    for stale in folder.glob("unit_*.json"):
        stale.unlink()
    plan = units.plan_units(files, fmt, unit_bytes)
    units.write_json_atomic(path, {"version": VERSION, "unit_bytes": unit_bytes, "sizes": sizes, "units": plan})
    return plan


def _recorded(folder: Path, n: int, width: int) -> dict[int, dict]:
    """The units an earlier launch finished: a record, and its shard whole beside it."""
    done = {}
    for k in range(n):
        try:
            record = json.loads((folder / units.record_name(k)).read_text())
        except (OSError, ValueError):
            continue
        shard = folder / record["file"] if record.get("file") else None
        whole = shard.is_file() and shard.stat().st_size == record["tokens"] * width if shard else record["tokens"] == 0
        sides = {"mask": record["tokens"], "lengths": record["documents"] * 4}  # data=chat's files beside it
        if whole and all(
            (folder / record[k]).is_file() and (folder / record[k]).stat().st_size == size
            for k, size in sides.items()
            if k in record
        ):
            done[k] = record
    return done


def _run(jobs: list[dict], nproc: int, lock_fd: int, meter: Meter, work=None) -> dict[int, dict]:
    """The units of `jobs` by a pool of processes, each by `work` (units.run_unit's), with
    progress: the records by unit."""
    if not jobs:
        return {}
    fork = "fork" in mp.get_all_start_methods()  # workers start at once, with the tokenizer loaded
    ctx = mp.get_context("fork" if fork else "spawn")
    progress = ctx.Queue()
    workers = min(nproc, len(jobs))
    pool = ProcessPoolExecutor(
        workers,
        mp_context=ctx,
        initializer=units.init_worker,
        initargs=(progress, os.getpid(), lock_fd if fork else None),
    )

    def drain() -> None:
        while True:
            try:
                _, nbytes, docs, tokens = progress.get_nowait()
            except queues.Empty:
                return
            meter.add(nbytes, docs, tokens)

    records: dict[int, dict] = {}
    try:
        pending = {pool.submit(units.run_unit, job, work): job["unit"] for job in jobs}  # forks the workers
        with meter:
            while pending:
                finished, _ = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                drain()
                for future in finished:
                    unit = pending.pop(future)
                    try:
                        record = future.result()
                    except BrokenProcessPool:
                        raise ConfigError(
                            "data.num_proc",
                            workers,
                            "a tokenizing process died (killed, or out of "
                            "memory?); launch again to continue where it stopped, or lower "
                            "data.num_proc",
                        ) from None
                    if "error" in record:  # the content (the key can never complete), or the file's reading
                        raise (ConfigError if record.get("resumable") else InputError)(*record["error"])
                    records[unit] = record
                meter.show()
            drain()
    except BaseException:
        for process in list((getattr(pool, "_processes", None) or {}).values()):  # ours: end them, do not wait
            process.terminate()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return records


def _index(
    cfg: Config,
    tok,
    dtype,
    fmt,
    files: list[Path],
    sizes: list[int],
    sums: list[str],
    records: list[dict],
    chat: dict | None = None,
) -> dict:
    d = cfg.data
    shards = [
        {k: r[k] for k in ("file", "tokens", "documents", "mask", "lengths") if k in r} for r in records if r["tokens"]
    ]
    return {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype.value,
        "tokens": sum(r["tokens"] for r in records),
        "documents": sum(r["documents"] for r in records),
        "shards": shards,
        "tokenizer": tok.identity,
        "tokenizer_spec": d.tokenizer,
        "vocab_size": tok.vocab_size,
        "eos_id": int(tok.eos_id),
        "text_field": d.text_field,
        "source_format": fmt.value,
        "sources": [{"path": str(f), "bytes": size, "sha256": s} for f, size, s in zip(files, sizes, sums)],
        **({**chat, "counted": sum(r["counted"] for r in records)} if chat else {}),
    }


def _tidy(folder: Path, index: dict, n: int) -> None:
    """After index.json: the records, the plan and any shard the index does not name go."""
    for k in range(n):
        (folder / units.record_name(k)).unlink(missing_ok=True)
    (folder / PLAN).unlink(missing_ok=True)
    named = {s[k] for s in index["shards"] for k in ("file", "mask", "lengths") if k in s}
    for shard in folder.glob("shard_*"):
        if shard.name not in named:
            shard.unlink()


def read_tokens(folder: Path):
    """A prepared directory's whole token stream in memory, and its index: for small data
    (tests, a look at what was made); the ranks read window by window (launcher/data/read.py)."""
    index = json.loads((Path(folder) / INDEX).read_text())
    dtype = np.dtype(index["dtype"])
    parts = [np.fromfile(Path(folder) / s["file"], dtype=dtype) for s in index["shards"]]
    return (np.concatenate(parts) if parts else np.empty(0, dtype=dtype)), index
