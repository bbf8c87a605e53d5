"""`python -m service.cli`: the `tidewire` command."""

from service.cli import main

raise SystemExit(main())
