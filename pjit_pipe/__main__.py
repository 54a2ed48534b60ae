"""`python -m pjit_pipe` runs the CLI."""

import sys

from pjit_pipe.cli import main

sys.exit(main())
