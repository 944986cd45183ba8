"""One module per storage backend; ``modelcache.backends`` names them (docs/backends.md)."""
