"""A requests adapter whose TLS verification is the one we configured, whatever the environment.

``requests`` lets ``REQUESTS_CA_BUNDLE``/``CURL_CA_BUNDLE`` override ``Session.verify`` (a
request without its own ``verify=`` takes the environment's bundle before the session's
setting is consulted, psf/requests#3829). Many images set those variables, so a CA or
``verify=False`` set on a session by a source (HDFS ``TLS_CA``/``TLS_SKIP_VERIFY``, the Hub's
custom CA bundle) was silently replaced by the system bundle. Clients that build their own
requests (the ``hdfs`` package) cannot pass ``verify=`` per call, so the adapter pins it.
"""

from __future__ import annotations

from typing import Any

from requests.adapters import HTTPAdapter


class PinnedVerifyAdapter(HTTPAdapter):
    def __init__(self, verify: bool | str, **kwargs: Any) -> None:
        self.pinned_verify = verify
        super().__init__(**kwargs)

    def send(self, request: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        kwargs["verify"] = self.pinned_verify
        return super().send(request, **kwargs)


def adapter(verify: bool | str | None, **kwargs: Any) -> HTTPAdapter:
    """An adapter pinned to ``verify``; None keeps requests' defaults (system/env bundle)."""
    return HTTPAdapter(**kwargs) if verify is None else PinnedVerifyAdapter(verify, **kwargs)
