"""What every program of the project shares and nothing in the pull flow owns: the RFC 3339 clock,
the one background loop, health and listening sockets, start-up errors, sizes, redaction,
progress counters, log lines, the store's reserved name and cheap file checks.

The lowest floor of the core (above ``errors`` only): these modules import nothing else of
``modelcache``, so the agent, the coordinator and the initializer take them without the pull
path. The import rules: docs/architecture.md, "Import rules".
"""
