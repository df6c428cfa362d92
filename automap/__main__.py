"""`python -m automap ...`: the same as the `automap` command."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
