"""``python -m freeride``: the same as the ``freeride`` command."""

import sys

from freeride.cli.main import main

sys.exit(main())
