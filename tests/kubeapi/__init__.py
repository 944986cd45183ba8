"""A Kubernetes API server for tests: real HTTP, in-memory state, the semantics controllers rely on.

No kube-apiserver can be installed on the project's machines (shared/TESTING.md §8), so this one
is driven by the official `kubernetes` client and kubectl, unmodified. Modules: resources (what is
served), store (write semantics), schema (CRD validation), selectors, patch, watch, tables
(server-side printing), discovery, server (HTTP routing). Run it with
`python -m tests.kubeapi --port PORT --crds deploy/crds`; it is ready when /version answers.

Test-only control endpoints (outside the API paths): POST /_kubeapi/compact drops the watch
history (every older resourceVersion then answers 410), POST /_kubeapi/drop-watches ends every
open watch stream (a disconnect as a client sees it).

Not modelled: authentication/authorization, admission webhooks, server-side apply field
ownership (apply-patch is a create-or-merge), foreground deletion (treated as background),
graceful pod termination (pods are deleted at once), version conversion between CRD versions.
"""

from __future__ import annotations

from tests.kubeapi.app import load_crds, make_server

__all__ = ["load_crds", "make_server"]
