"""`python -m tests.kserve build`: build KServe's controller manager if its pin changed."""

from __future__ import annotations

import argparse

from tests.kserve.build import KSERVE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.kserve", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["build"])
    parser.parse_args(argv)
    KSERVE.ensure()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
