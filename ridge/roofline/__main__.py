"""``python -m ridge.roofline ...``: ``ridge analyze ...``."""

import sys

from ridge.cli import main

sys.exit(main(["analyze", *sys.argv[1:]]))
