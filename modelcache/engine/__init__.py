"""The transfer engine: a model's bytes from a ``Source`` into the store's staged files, in
parallel ranged reads, verified in one pass and resumable.

``transfer`` (``TransferEngine``: the workers, the runs of chunks, the finish of each file),
``transfer_files`` (a file's chunks, buffers and in-order hash cursor), ``transfer_control``
(request sizes, retries and the watchdog) and ``resources`` (the settings' limits, checked before
a pull starts). The engine reads through the ``Source`` interface and ``modelcache.sources.remote``
only, never a backend module, and writes through ``modelcache.store.diskio`` and
``modelcache.store.journal``; it never imports the peers (a peer-aware source is handed to it
as any other ``Source``).
"""
