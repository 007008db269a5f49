"""`python -m selfspec.cli ...`: the `selfspec` command."""

import sys

from . import main

sys.exit(main())
