"""In-memory git-like repositories for the test Hub: commits, branches, tags, LFS pointers.

Digests are computed the way the Hub does, so clients checking them see real values: a plain
file's oid is its git blob sha1 (``sha1(b"blob <len>\\0" + content)``); an LFS file is stored in
git as a pointer text whose blob sha1 is the tree ``oid``, while ``lfs.oid`` (and the download
ETag) is the sha256 of the content.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

COMMIT_RE = re.compile(r"[0-9a-f]{40}")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass
class HubFile:
    path: str
    data: bytes
    lfs: bool
    blob_oid: str  # git blob sha1 of what git stores: the content, or the LFS pointer
    sha256: str
    pointer_size: int = 0
    #: Byte offsets served flipped (tests: corruption behind a correct checksum).
    corrupt_at: set[int] = field(default_factory=set)

    @classmethod
    def build(cls, path: str, data: bytes, lfs: bool) -> HubFile:
        sha256 = hashlib.sha256(data).hexdigest()
        if lfs:
            pointer = lfs_pointer(sha256, len(data))
            return cls(path, data, True, git_blob_sha1(pointer), sha256, len(pointer))
        return cls(path, data, False, git_blob_sha1(data), sha256)

    @property
    def etag(self) -> str:
        """What the Hub puts in ETag / X-Linked-Etag: sha256 for LFS, the git blob sha1 otherwise."""
        return self.sha256 if self.lfs else self.blob_oid

    def served_bytes(self) -> bytes:
        if not self.corrupt_at:
            return self.data
        buf = bytearray(self.data)
        for off in self.corrupt_at:
            if 0 <= off < len(buf):
                buf[off] ^= 0xFF
        return bytes(buf)


@dataclass(frozen=True)
class Commit:
    sha: str
    files: Mapping[str, HubFile]
    parent: str | None
    title: str
    date: datetime

    def directories(self) -> list[str]:
        dirs: set[str] = set()
        for path in self.files:
            parts = path.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                dirs.add("/".join(parts[:i]))
        return sorted(dirs)

    def tree_oid(self, directory: str) -> str:
        prefix = directory + "/"
        entries = sorted(f"{p}:{f.blob_oid}" for p, f in self.files.items() if p.startswith(prefix))
        return hashlib.sha1(("tree\n" + "\n".join(entries)).encode()).hexdigest()


class HubRepo:
    """One model repository. Mutations are atomic under ``lock`` (tests move refs mid-request)."""

    def __init__(self, repo_id: str, *, lfs_threshold: int, private: bool = False, gated: bool = False) -> None:
        self.repo_id = repo_id
        self.private = private
        self.gated = gated
        #: Tokens that may read a private repo / passed a gated repo's access request.
        self.allowed_tokens: set[str] = set()
        self.lfs_threshold = lfs_threshold
        self.commits: dict[str, Commit] = {}
        self.branches: dict[str, str] = {}
        self.tags: dict[str, str] = {}
        self.lock = threading.RLock()
        self._counter = 0

    def commit(
        self,
        files: Mapping[str, bytes | None],
        *,
        branch: str = "main",
        message: str = "update",
        lfs: set[str] | None = None,
        replace: bool = False,
    ) -> str:
        """Commit ``files`` (None deletes a path) on top of ``branch``; return the new commit sha.

        ``lfs`` forces paths into LFS; otherwise files of at least ``lfs_threshold`` bytes are LFS.
        ``replace`` starts from an empty tree instead of the branch head.
        """
        with self.lock:
            parent = self.branches.get(branch)
            tree: dict[str, HubFile] = {} if replace or parent is None else dict(self.commits[parent].files)
            for path, data in files.items():
                if data is None:
                    tree.pop(path, None)
                    continue
                is_lfs = (lfs is not None and path in lfs) or len(data) >= self.lfs_threshold
                tree[path] = HubFile.build(path, data, is_lfs)
            self._counter += 1
            digest_src = "\n".join(f"{p}:{f.blob_oid}" for p, f in sorted(tree.items()))
            sha = hashlib.sha1(f"commit {self.repo_id} {parent} {self._counter} {message}\n{digest_src}".encode())
            commit = Commit(sha.hexdigest(), tree, parent, message, datetime.now(UTC))
            self.commits[commit.sha] = commit
            self.branches[branch] = commit.sha
            return commit.sha

    def set_branch(self, name: str, sha: str) -> None:
        with self.lock:
            self.branches[name] = self._known(sha)

    def set_tag(self, name: str, sha: str) -> None:
        with self.lock:
            self.tags[name] = self._known(sha)

    def _known(self, sha: str) -> str:
        if sha not in self.commits:
            raise KeyError(f"unknown commit {sha}")
        return sha

    def resolve(self, rev: str) -> Commit | None:
        """Branch, tag, full commit sha, or ``refs/heads/x`` / ``refs/tags/x``."""
        with self.lock:
            if COMMIT_RE.fullmatch(rev) and rev in self.commits:
                return self.commits[rev]
            if rev.startswith("refs/heads/"):
                sha = self.branches.get(rev[len("refs/heads/") :])
            elif rev.startswith("refs/tags/"):
                sha = self.tags.get(rev[len("refs/tags/") :])
            else:
                sha = self.branches.get(rev) or self.tags.get(rev)
            return self.commits[sha] if sha else None

    def file(self, rev: str, path: str) -> HubFile:
        commit = self.resolve(rev)
        if commit is None:
            raise KeyError(rev)
        return commit.files[path]
