"""One size syntax, one (binary) meaning in every flag and environment variable; Kubernetes quantities
in the CRDs stay Kubernetes quantities."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from modelcache.kube.quantity import parse_quantity
from modelcache.runtime.sizes import parse_size

MIB16 = 16 << 20


@pytest.mark.parametrize("text", ["16M", "16m", "16Mi", "16MiB", "16MB", "16mb", " 16 M ", "16777216"])
def test_every_spelling_of_16_mebibytes(text: str) -> None:
    assert parse_size(text) == MIB16


def test_fractions_units_and_refusals() -> None:
    assert parse_size("1.5G") == 3 << 29 and parse_size("2T") == 2 << 40 and parse_size("512K") == 512 << 10
    assert parse_size("100") == 100 and parse_size("100B") == 100 and parse_size("1P") == 1 << 50
    for bad in ("", "M", "16X", "-1M", "16 MiBs", "1e6", "16Mi B"):
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(bad)


def test_the_cli_the_initializer_and_the_agent_read_16M_alike(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """16M was 16 MiB to `modelcache pull` and the initializer but 16,000,000 bytes to the agent."""
    import agent.__main__ as agent_main
    from initializer.__main__ import transfer_options
    from modelcache.cli.commands import SizeType

    assert SizeType().convert("16M", None, None) == MIB16
    assert transfer_options({"MODELCACHE_CHUNK_SIZE": "16M"}).chunk_size == MIB16
    seen = []
    monkeypatch.setattr(agent_main, "run", lambda cfg, *_: seen.append(cfg) or 0)
    result = CliRunner().invoke(agent_main.cli, ["--node", "n", "--chunk-size", "16M"],
                                env={"MODELCACHE_SPACE_MARGIN": "256M", "KUBECONFIG": ""})
    assert result.exit_code == 0, result.output
    assert seen[-1].chunk_size == MIB16 and seen[-1].space_margin == 256 << 20
    bad = CliRunner().invoke(agent_main.cli, ["--node", "n", "--chunk-size", "16X"], env={"KUBECONFIG": ""})
    assert bad.exit_code == 2 and "'16X' is not a size" in bad.output


def test_crd_quantities_stay_kubernetes_quantities() -> None:
    """storageLimit is a Kubernetes quantity: 16M is 16,000,000 bytes there, as kubectl reads it."""
    assert parse_quantity("16M") == 16_000_000 and parse_quantity("16Mi") == MIB16
    assert parse_quantity("1Gi") == 1 << 30 and parse_quantity("1G") == 10**9
