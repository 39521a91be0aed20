"""The canonical view: Tunix's wrapper levels as rules, applied to a step's paths once.

  rules.py          each wrapper level Tunix adds, as a small value
  canonical_map.py  the rules applied to one item's leaf paths (`CanonicalMap`)
  detection.py      what a path holds and which rewrites apply (`Detection`)
"""
