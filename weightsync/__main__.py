"""Entry point for ``python -m weightsync``."""

import sys

from weightsync.cli import main

sys.exit(main())
