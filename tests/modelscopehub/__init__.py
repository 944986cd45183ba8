"""A ModelScope Hub test server (real HTTP), checked in tests with the official modelscope client."""

from tests.modelscopehub.server import MSFile, MSHub, MSRequest

__all__ = ["MSFile", "MSHub", "MSRequest"]
