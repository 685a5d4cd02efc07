"""``python -m tracinfunc`` runs the command line."""

import sys

from tracinfunc.cli import main

if __name__ == "__main__":  # importing the module (docs, package walkers) must not run it
    sys.exit(main())
