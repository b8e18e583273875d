"""`python -m quantship ...` (and `torchrun -m quantship ...`) is the `quantship` command."""

import sys

from quantship.cli import main

sys.exit(main())
