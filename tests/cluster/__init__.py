"""The real Kubernetes control plane for tests and the demo, built from upstream Go modules.

`python -m tests.cluster up DIR [--nodes N]` runs one in the foreground; `tests/fixtures/cluster.py`
wraps the same `ControlPlane` for pytest.
"""
