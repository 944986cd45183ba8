"""The one registry of storage backends: one line per backend.

A line names the backend's kind (the only place it is spelled), its Source class and its
Location class, as ``module:Class`` strings imported on first use: one backend's SDK is never
loaded for another's URI, and this module imports nothing. A Location defined in ``uri.py`` is
matched there, in KServe's dispatch order; a backend whose Location lives in its own module
lists the URI prefixes it parses and the form shown in the invalid-URI error. How to add a
backend: docs/backends.md.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Backend:
    source: str  # "module:Class" of its Source
    location: str  # "module:Class" of its Location (":Class": in the Source's module)
    prefixes: tuple[str, ...] = ()  # URI prefixes, for a Location outside uri.py
    form: str = ""  # the accepted URI form shown in errors (default: the first prefix)
    #: "module:function" building its settings from the environment snapshot (``Settings.for_kind``),
    #: called on the first use of that backend in a pull ("": it reads only the shared HTTP settings).
    settings: str = ""

    def __post_init__(self) -> None:
        if self.location.startswith(":"):
            object.__setattr__(self, "location", self.source.partition(":")[0] + self.location)
        if self.prefixes and not self.form:
            object.__setattr__(self, "form", f"{self.prefixes[0]}...")


_C = "modelcache.sources.credentials:"

BACKENDS: dict[str, Backend] = {
    "s3": Backend("modelcache.sources.s3:S3Source", "modelcache.sources.uri:S3Location", settings=_C + "s3_from_env"),
    "gcs": Backend("modelcache.sources.gcs:GCSSource", "modelcache.sources.uri:GCSLocation",
                   settings=_C + "gcs_from_env"),
    "azure": Backend("modelcache.sources.azure:AzureBlobSource", "modelcache.sources.uri:AzureBlobLocation",
                     settings=_C + "azure_from_env"),
    "hf": Backend("modelcache.sources.hf:HFSource", "modelcache.sources.uri:HFLocation", settings=_C + "hf_from_env"),
    "oci": Backend("modelcache.sources.oci:OCISource", "modelcache.sources.uri:OCILocation",
                   settings=_C + "oci_from_env"),
    "hdfs": Backend("modelcache.sources.hdfs:HDFSSource", "modelcache.sources.uri:HDFSLocation",
                    settings=_C + "hdfs_from_env"),
    "pvc": Backend("modelcache.sources.local:LocalSource", "modelcache.sources.uri:PVCLocation",
                   settings=_C + "local_from_env"),
    "local": Backend("modelcache.sources.local:LocalSource", "modelcache.sources.uri:LocalLocation",
                     settings=_C + "local_from_env"),
    "http": Backend("modelcache.sources.http:HTTPSource", "modelcache.sources.uri:HTTPLocation"),
    "modelscope": Backend("modelcache.sources.modelscope:ModelScopeSource", ":ModelScopeLocation", ("modelscope://",)),
}


def load(path: str) -> Any:
    """The object a ``module:Class`` string names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def kind_of(location_class: type[Any]) -> str:
    """The kind whose line names this Location class ("" for none: a form that is refused)."""
    path = f"{location_class.__module__}:{location_class.__qualname__}"
    for kind, backend in BACKENDS.items():
        if backend.location == path:
            return kind
    return ""


def external() -> list[Backend]:
    """The backends whose Location is parsed in their own module, not in uri.py."""
    return [b for b in BACKENDS.values() if b.prefixes]
