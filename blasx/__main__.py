"""``python -m blasx``: the ``blasx`` command (blasx.cli)."""

import sys

from .cli import main

sys.exit(main())
