"""``python -m ridge.roofline analyze ...``: the same command without the rest of the CLI."""

import sys

from ridge.roofline.cli import main

sys.exit(main())
