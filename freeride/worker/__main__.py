"""``python -m freeride.worker``: started by the manager, one per iterative side task."""

import sys

from freeride.worker.main import main

sys.exit(main())
