"""``python -m graphrunner_tools``: the ``graphrunner`` command line."""

import sys

from graphrunner_tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
