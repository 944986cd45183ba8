"""The name the store reserves: its bookkeeping folder, beside ``models/`` in a node root and
inside DEST while an init container runs.

Only ``modelcache.store`` writes under it or builds paths in it. The name lives here, below
both the store and the sources (which may not import the store), so that a listing or an
archive that names it is refused and a local copy skips it: a model's files can never land
in our bookkeeping.
"""

META_DIR = ".modelcache"
