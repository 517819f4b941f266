"""`python -m specdec.cli`: the `specdec` command."""
import sys

from . import main

sys.exit(main())
