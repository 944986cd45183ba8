"""KServe's own controller manager, built from its published Go module (tests/kserve/go.mod) and run
against the real control plane (tests/cluster) beside our coordinator and agents."""
