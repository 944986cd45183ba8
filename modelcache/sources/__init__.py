"""Where a model's bytes come from: the URI parsed into a typed location (``uri``), the one
registry of backends (``backends``), their settings (``credentials``, ``cabundle``), one module
per backend (``modelcache.sources.backends`` names them; docs/backends.md), and what every source
hands to the floors above: ``remote`` (``RemoteFile``, ``Checksum``, ``RangeStream``),
``integrity`` (the hashers a file is checked with against what its source vouches for), and
``archive`` and ``compression`` (the formats a source may serve: one archive over HTTP, tar
layers from a registry). Nothing here imports the engine, the store or the pull."""
