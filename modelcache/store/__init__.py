"""The store: staged downloads, atomic publish, manifests, locks, eviction. Only this package
writes under its bookkeeping folder (``META_DIR``) or builds a path there.

Two kinds behind one ``Store``: ``NodeStore``, a node root that serving pods read (its layout
is drawn once, in docs/architecture.md, "The node store"), and ``DestStore``, the init
container's destination folder, which holds one model and keeps the bookkeeping in
``<dest>/.modelcache/`` until the pair is done. A staging folder's files are drawn in
``staging``'s docstring.

The modules: ``manifest`` (what a publish records), ``layout`` (where things are), ``locks``,
``staging`` (a staged download), ``base`` (``Store``: what both kinds share), ``node`` and
``dest`` (the two kinds), ``steps`` (the publish steps crash tests stop at); below them what
writes to the disk: ``journal`` (a staged download's resume journal), ``diskio`` (aligned
``O_DIRECT`` writes, atomic files, fsync), and what the mount table says about a root:
``mountinfo``, ``lockscope`` (does ``flock`` exclude other hosts) and ``mountusers`` (which
mounts show a model folder). The transfer engine and the peers write staged files through
``journal`` and ``diskio``: that is why the store sits below them.
"""

from modelcache.store.base import Damage, Guard, Store
from modelcache.store.dest import DestStore
from modelcache.store.layout import DestLayout, Layout, NodeLayout, first_stop, regular_file_inside
from modelcache.store.locks import RootLock
from modelcache.store.manifest import MANIFEST_VERSION, Manifest, ManifestFile, VerifyProblem, file_matches, seal_of
from modelcache.store.node import NodeStore, StoreEntry, TargetUnreachableError
from modelcache.store.staging import Prepared, StagedPull, Staging
from modelcache.store.steps import PUBLISH_STEPS, REPAIR_STEPS

__all__ = [
    "MANIFEST_VERSION", "PUBLISH_STEPS", "REPAIR_STEPS", "Damage", "DestLayout", "DestStore", "Guard", "Layout",
    "Manifest", "ManifestFile", "NodeLayout", "NodeStore", "Prepared", "RootLock", "StagedPull", "Staging", "Store",
    "StoreEntry", "TargetUnreachableError", "VerifyProblem", "file_matches", "first_stop", "regular_file_inside",
    "seal_of",
]
