"""Reading a step in the canonical view: one read path, from requests to values.

  read_requests.py  what to ask Orbax for, per leaf (a target and its restore args)
  planned_item.py   one item planned; every read goes through `PlannedItem.read`
  reader.py         a step as canonical leaves, read in bounded batches
  hyperparams.py    the values an `optax.inject_hyperparams` shell holds
"""
