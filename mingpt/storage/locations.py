"""What a storage location is: a local path (relative = to the project folder) or an fsspec URL, checked before
anything is read or written there. The one rule behind every location: data, the encoded-corpus cache, snapshots,
sample.py and snapshot.py."""

from __future__ import annotations

import re
from pathlib import Path

import fsspec

from mingpt import PROJECT_DIR
from mingpt.errors import UsageError

# What starts a URL: a scheme (RFC 3986) and a colon. Such a location is parsed as a URL or refused; it is never
# taken for a local path (`s3:/bucket/run` would otherwise be a local folder named `s3:`). `runs/a:b` is local.
URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
# Protocols whose URLs name a path without a bucket or host (file:///abs/path, memory://x, hdfs:///user/x); every
# other protocol needs one: s3://BUCKET/..., http://HOST/...
HOSTLESS_PROTOCOLS = frozenset({"file", "local", "memory", "hdfs", "arrow_hdfs"})
HOST_PROTOCOLS = frozenset({"http", "https", "ftp", "sftp", "ssh", "smb", "webdav", "webhdfs"})  # for the messages


def check_location(location: str, what: str = "storage location") -> bool:
    """True for a URL, False for a local path; a UsageError (one line) for anything that looks like a URL but is
    not a usable one. The one check behind every storage location (data, snapshots, sample.py, snapshot.py).

    The rule: a location that starts with a scheme and a colon (`^[A-Za-z][A-Za-z0-9+.-]*:`) is a URL, and must be
    `PROTOCOL://...` with a protocol fsspec knows and a non-empty bucket or host (`file:///ABSOLUTE/PATH` for
    files); chained URLs (`simplecache::s3://bucket/x`) are checked part by part. Anything else is a local path,
    which may not contain `://` or `::` (fsspec would read those as a URL). A local name that starts with
    `word:` is written `./word:...`.
    """
    if not location.strip():
        raise UsageError(f"{what} is empty")
    if not URL_SCHEME.match(location):
        if "://" in location or "::" in location:
            raise UsageError(f"{what} {location!r} is not a URL (it does not start with PROTOCOL://) nor a local path "
                             f"(a local path cannot contain '://' or '::')")
        return False
    known = set(fsspec.available_protocols())
    parts = location.split("::")
    for i, part in enumerate(parts):
        if i < len(parts) - 1 and part in known:
            continue  # the bare protocol of a chain link, as in simplecache::s3://...
        _check_url(part, location, what, known)
    return True


def _check_url(url: str, location: str, what: str, known: set[str]) -> None:
    scheme = URL_SCHEME.match(url)
    if scheme is None:
        raise UsageError(f"{what} {location!r}: {url!r} in a chained URL is not a URL (PROTOCOL://...)")
    protocol, rest = scheme.group()[:-1], url[scheme.end():]
    if protocol not in known:
        hint = f"did you mean {protocol.lower()}://?" if protocol.lower() in known else (
            "fsspec knows s3, gs, az, http, https, ftp, sftp, file, memory, ...")
        local = "" if rest.startswith("//") else f"; a local path is written ./{location}"
        raise UsageError(f"{what} {location!r}: unknown protocol {protocol!r} ({hint}{local})")
    if protocol in ("file", "local"):
        shape = f"{protocol}:///ABSOLUTE/PATH"
    elif protocol in HOSTLESS_PROTOCOLS:
        shape = f"{protocol}://PATH"
    else:
        shape = f"{protocol}://{'HOST' if protocol in HOST_PROTOCOLS else 'BUCKET'}/PATH"
    if not rest.startswith("//"):
        raise UsageError(f"{what} {location!r} is not a complete URL: {protocol + ':'!r} must be followed by '//' "
                         f"(expected {shape})")
    rest = rest[2:]
    if protocol in ("file", "local") and rest and not rest.startswith("/"):
        # fsspec would take file://runs/x relative to the current directory, not to the project
        raise UsageError(f"{what} {location!r}: a {protocol} URL needs an absolute path (expected {shape}; a "
                         f"relative local path is written without {protocol}://)")
    if not rest or (protocol not in HOSTLESS_PROTOCOLS and not rest.split("/", 1)[0]):
        missing = "path" if protocol in HOSTLESS_PROTOCOLS else ("host" if protocol in HOST_PROTOCOLS else "bucket")
        raise UsageError(f"{what} {location!r}: no {missing} after '{protocol}://' (expected {shape})")


def resolve_path(path: str) -> str:
    """A URL stays as it is; a relative local path is taken relative to the project, not the cwd. Anything that
    looks like a URL but is not a usable one is a UsageError (see `check_location`)."""
    if check_location(path):
        return path
    local = Path(path).expanduser()
    return str(local if local.is_absolute() else PROJECT_DIR / local)
