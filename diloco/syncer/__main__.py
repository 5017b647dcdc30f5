"""``python -m diloco.syncer``: the same as the ``yeto-syncer`` console script."""

from diloco.syncer.cli import main

raise SystemExit(main())
