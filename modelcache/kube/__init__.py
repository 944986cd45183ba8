"""Kubernetes layer: typed CRD objects, a thin client, and a small controller runtime.

This package (with ``agent/`` and ``coordinator/``) is the only code that imports the
``kubernetes`` client; the core library never does. ``types`` itself is plain Python so
that callers can build and read our objects without a cluster.
"""
