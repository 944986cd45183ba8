"""Entry point placeholder until the coordinator issue lands."""

import sys


def main() -> None:
    print("modelcache-coordinator: not implemented yet", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
