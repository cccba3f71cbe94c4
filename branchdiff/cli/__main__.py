"""`python -m branchdiff.cli ...`, as `accelerate launch -m branchdiff.cli train ...` starts it."""

import sys

from branchdiff.cli.main import main

sys.exit(main())
