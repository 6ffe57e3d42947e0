"""`python -m loom.cli ...` is the `loom` command (servers under test are started so)."""

import sys

from loom.cli.main import main

sys.exit(main())
