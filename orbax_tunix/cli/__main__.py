"""`python -m orbax_tunix.cli`: the same as the `orbax-tunix` command."""

import sys

from orbax_tunix.cli.commands import main

sys.exit(main())
