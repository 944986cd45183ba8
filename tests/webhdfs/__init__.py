"""A WebHDFS test server (namenode + datanode over real HTTP), checked with the ``hdfs`` client."""

from tests.webhdfs.server import Request, WebHDFSServer

__all__ = ["Request", "WebHDFSServer"]
