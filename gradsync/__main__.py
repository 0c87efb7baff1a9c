"""``python -m gradsync``: the same command line as the ``gradsync`` script."""

from .run.cli import main

raise SystemExit(main())
