#!/usr/bin/env python3
"""A frozen copy of one commit of this checkout on the GPU host, whatever else the working tree holds.

Each device call copies the CPU machine's working tree as it is, with the uncommitted edits of everyone working in
it; a long run started from that copy imports files that change under it at every later call (`README.md`, section
4). `pack` (CPU machine) writes ``.gpu/head/``: the commit, every tracked file's git blob id, and the committed
content of the files the working tree changed (carry ``.gpu/head`` with the call); `make DEST` (host) copies the
checkout to DEST, puts those files back, removes files added since the commit, and checks every tracked file against
its blob id: the run then starts from exactly that commit (untracked files come along, unused by it).

    python3 benchmarks/gpu/snapshot.py pack            # CPU machine, right before the call
    python3 benchmarks/gpu/snapshot.py make /root/snap # host: exit 1 naming the files that differ
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEAD_DIR = ".gpu/head"


def git(root: str, *args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, check=True).stdout


def blob_id(data: bytes) -> str:
    """git's object id of a blob with this content (what ``git hash-object`` prints)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def pack(root: str = ROOT) -> dict:
    """``.gpu/head/manifest.json`` (commit, path -> [mode, blob id]) and ``files.tar`` (the committed content of
    every tracked file the working tree changed or deleted); files added since the commit are listed to remove."""
    commit = git(root, "rev-parse", "HEAD").decode().strip()
    files = {}
    for line in git(root, "ls-tree", "-r", "-z", "HEAD").decode().split("\0"):
        if line:
            meta, path = line.split("\t", 1)
            mode, _, oid = meta.split(" ")
            files[path] = [mode, oid]
    changed = [p for p in git(root, "diff", "--name-only", "-z", "HEAD").decode().split("\0") if p]
    out = os.path.join(root, HEAD_DIR)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in changed:
            if path not in files:
                continue
            data = git(root, "cat-file", "blob", files[path][1])
            info = tarfile.TarInfo(path)
            if files[path][0] == "120000":
                info.type, info.linkname = tarfile.SYMTYPE, data.decode()
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o755 if files[path][0] == "100755" else 0o644
                tar.addfile(info, io.BytesIO(data))
    with open(os.path.join(out, "files.tar"), "wb") as f:
        f.write(buf.getvalue())
    doc = {"commit": commit, "files": files, "restore": [p for p in changed if p in files],
           "remove": [p for p in changed if p not in files]}
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(doc, f)
    return doc


def verify(dest: str, files: dict) -> list[str]:
    """Tracked files of ``dest`` whose content is not the commit's."""
    bad = []
    for path, (mode, oid) in files.items():
        p = os.path.join(dest, path)
        if mode == "160000":  # a submodule: not checked out here
            continue
        try:
            data = os.readlink(p).encode() if mode == "120000" else open(p, "rb").read()
        except OSError:
            bad.append(f"{path} (missing)")
            continue
        if blob_id(data) != oid:
            bad.append(path)
    return bad


def make(dest: str, src: str = ROOT) -> dict:
    """``dest``: a copy of ``src`` (without .git and .gpu) at the commit ``src/.gpu/head`` describes; raises
    SystemExit naming the files that still differ."""
    with open(os.path.join(src, HEAD_DIR, "manifest.json")) as f:
        doc = json.load(f)
    shutil.rmtree(dest, ignore_errors=True)
    skip = {os.path.join(src, n) for n in (".git", ".gpu", ".venv")}  # pieces and environments: not the code
    shutil.copytree(src, dest, symlinks=True, ignore=lambda d, names: [n for n in names if os.path.join(d, n) in skip])
    for path in doc["remove"]:
        p = os.path.join(dest, path)
        if os.path.lexists(p):
            os.remove(p)
    for path in doc["restore"]:  # a link or file left by the edit would be written through
        p = os.path.join(dest, path)
        if os.path.lexists(p):
            os.remove(p)
    with tarfile.open(os.path.join(src, HEAD_DIR, "files.tar")) as tar:
        tar.extractall(dest, filter="tar")
    bad = verify(dest, doc["files"])
    if bad:
        raise SystemExit(f"snapshot: {len(bad)} file(s) of {dest} differ from commit {doc['commit'][:12]}: "
                         + ", ".join(bad[:10]))
    print(f"snapshot: {dest} = commit {doc['commit'][:12]} ({len(doc['files'])} tracked files checked; "
          f"{len(doc['restore'])} restored, {len(doc['remove'])} removed)", flush=True)
    return doc


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["pack", "make"])
    ap.add_argument("dest", nargs="?")
    a = ap.parse_args()
    if a.action == "pack":
        d = pack()
        print(f"snapshot: {HEAD_DIR} = commit {d['commit'][:12]}, {len(d['restore'])} file(s) to restore, "
              f"{len(d['remove'])} to remove")
    else:
        if not a.dest:
            sys.exit("snapshot make DEST")
        make(a.dest)
