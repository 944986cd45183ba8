"""The destination store: models written straight into one folder (the init container's
/mnt/models), its bookkeeping inside it (``<dest>/.modelcache/``) until the pair is done."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from modelcache.runtime.progress import human_bytes
from modelcache.runtime.reserved import META_DIR
from modelcache.store.base import Store
from modelcache.store.layout import DestLayout


class DestStore(Store):
    #: The destination is the model folder: a publish merges into it (pods of other pairs that
    #: share the DEST keep their files).
    merges = True
    layout: DestLayout

    def __init__(self, layout: DestLayout) -> None:
        super().__init__(layout)

    @classmethod
    def at(cls, dest: str | os.PathLike[str]) -> DestStore:
        return cls(DestLayout(Path(dest)))

    def unlisted_dir(self, key: str) -> Path:
        return self.layout.meta / "unlisted"

    def foreign_names(self, key: str) -> list[str]:
        """What the destination holds besides the store's own bookkeeping."""
        return [n for n in super().foreign_names(key) if n != META_DIR]

    def drop_staging(self, key: str) -> None:
        """Kept: a destination's staged download is what the init container's retry resumes,
        and pairs that share the DEST share the folder."""

    def record_failure(self, key: str, reason: str, message: str) -> None:
        """Not kept: nothing lists a destination's staged downloads (the container's log says why)."""

    def no_room_advice(self, key: str, need: int, short: int, fs_total: int, margin: int) -> str:
        if fs_total < need:
            return (f"this file system ({human_bytes(fs_total)} in all) is too small for the model plus the margin: "
                    "pull it into a larger one" + (", or lower --space-margin" if margin else ""))
        return "free space on that file system"

    def clear_bookkeeping(self) -> None:
        """Remove the store's folder from a DEST whose pair is done: runtimes that take every
        sub-directory for a model (Triton) must not find it."""
        shutil.rmtree(self.layout.meta, ignore_errors=True)
