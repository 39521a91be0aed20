"""Writing: the one streaming writer, its sinks, staging and atomic commits, across hosts.

  writer.py       outputs read, transformed and written in bounded batches (Orbax, safetensors)
  commit.py       a destination seen only once complete; what each kind may replace
  checksums.py    a checksum per array written
  distributed.py  one process per host under JAX's runtime: shares, barriers, one commit
"""
