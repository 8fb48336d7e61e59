"""``python -m swap_pass`` runs the ``swap-pass`` command line."""

from swap_pass.tools.cli import main

raise SystemExit(main())
