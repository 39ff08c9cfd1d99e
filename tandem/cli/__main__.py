"""`python -m tandem.cli ...`, as Ray jobs run the CLI: the same as the `tandem` script."""

import sys

from tandem.cli.app import main

sys.exit(main())
