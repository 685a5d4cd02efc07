"""``python -m tracinfunc`` runs the command line."""

import sys

from tracinfunc.cli import main

sys.exit(main())
