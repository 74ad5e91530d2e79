"""``python -m lightning_fleet`` runs the ``fleet`` command."""

import sys

from lightning_fleet.cli import main

sys.exit(main())
