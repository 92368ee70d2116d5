"""`python -m kvbench` is the same as the `kvbench` command."""

from kvbench.cli import main

raise SystemExit(main())
