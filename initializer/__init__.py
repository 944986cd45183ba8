"""storage-initializer: KServe's init-container entrypoint (SRC DEST pairs) on the modelcache core."""
