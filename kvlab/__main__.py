"""``python -m kvlab``: the ``kvlab`` command (``kvlab.cli``)."""

import sys

from kvlab.cli import main

if __name__ == "__main__":
    sys.exit(main())
