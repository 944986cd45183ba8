"""KServe's LocalModel* example objects and small helpers for the CRD contract tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tests.helpers import REPO

EXAMPLES = REPO / "tests" / "cluster" / "kserve-localmodel-examples.yaml"
GROUP, VERSION = "serving.kserve.io", "v1alpha1"
PLURALS = {
    "LocalModelCache": "localmodelcaches", "LocalModelNamespaceCache": "localmodelnamespacecaches",
    "LocalModelNode": "localmodelnodes", "LocalModelNodeGroup": "localmodelnodegroups",
    "ClusterStorageContainer": "clusterstoragecontainers",
}


def examples(path: Path = EXAMPLES) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(path.read_text()) if d}


def api_error(exc: Any) -> dict[str, Any]:
    """The Status body of a kubernetes.client ApiException."""
    return json.loads(exc.body)
