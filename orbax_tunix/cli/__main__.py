"""`python -m orbax_tunix.cli`: the same as the `orbax-tunix` command."""

from orbax_tunix.cli import console

console()
