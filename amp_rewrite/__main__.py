"""`python -m amp_rewrite` is the `amp-rewrite` command."""

from amp_rewrite.cli import main

raise SystemExit(main())
