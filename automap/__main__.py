"""`python -m automap demo`."""

import sys


def main(argv=None) -> int:
    """Entry point: `demo` runs the built-in example."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:
        from ._demo import run

        return run()
    print("usage: automap demo", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
