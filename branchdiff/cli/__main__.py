"""`python -m branchdiff.cli ...`, as `accelerate launch -m branchdiff.cli train ...` starts it."""

from branchdiff.cli.main import run

run()
