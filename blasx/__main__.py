"""``python -m blasx``: the ``blasx`` command (blasx.cli)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
