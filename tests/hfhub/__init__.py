"""A Hugging Face Hub test server (real HTTP), driven in tests by huggingface_hub itself."""

from tests.hfhub.repo import HubFile, HubRepo, git_blob_sha1
from tests.hfhub.server import HubServer, Request

__all__ = ["HubFile", "HubRepo", "HubServer", "Request", "git_blob_sha1"]
