"""The agent's log lines: the one structured format of every long-running modelcache process
(``modelcache.runtime.logs``), re-exported under the name the agent's modules use."""

from modelcache.runtime.logs import StructuredFormatter, fields, setup_logging

__all__ = ["StructuredFormatter", "fields", "setup_logging"]
