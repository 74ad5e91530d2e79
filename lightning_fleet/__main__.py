"""``python -m lightning_fleet`` runs the ``fleet`` command.

Imports only the CLI; run as ``python -m lightning_fleet``.
"""

import sys

from lightning_fleet.cli import main

sys.exit(main())
