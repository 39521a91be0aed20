"""`orbax-tunix`: inspect, convert, export and diff checkpoints from the command line.

  commands.py  the arguments, the commands, errors shown as this command's flags
  display.py   tables, aligned text and JSON for people and scripts
  progress.py  progress bars and lines; signals that stop a conversion cleanly

The work is done by the library (`inspection`, `convert`, `export`, `diff`).
"""

from orbax_tunix.cli.commands import main

__all__ = ['main']
