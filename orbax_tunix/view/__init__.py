"""The canonical view: Tunix's wrapper levels as rules, applied to a step's paths once.

  rules.py          each wrapper level Tunix adds, as a small value
  canonical_map.py  the rules applied to one item's leaf paths (`CanonicalMap`)
  source_kinds.py   the kinds of step (Tunix run, MaxText step, plain Orbax) as data
  detection.py      what a path holds and which rewrites apply (`Detection`)
"""
