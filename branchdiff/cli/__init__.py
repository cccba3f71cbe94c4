"""The command line (the top layer): `branchdiff train | config | sample | eval | rewards | serve-reward |
bench | report | accelerate-config`, also run as `python -m branchdiff.cli` (e.g. under `accelerate launch`).

It may import every layer below it; nothing imports it. A command module parses nothing itself:
branchdiff/cli/parser.py builds the parser, branchdiff/cli/main.py runs the command and prints errors.
"""

from branchdiff.cli.main import main, run

__all__ = ["main", "run"]
