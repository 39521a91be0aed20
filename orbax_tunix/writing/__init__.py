"""Writing: the one streaming writer, its sinks, staging and atomic commits, across hosts.

  writer.py         outputs read, transformed and written in bounded batches (Orbax, safetensors)
  commit.py         a destination seen only once complete; what each kind may replace
  checksums.py      a checksum per array written (and the CRC-32 arithmetic of shares)
  places.py         where a destination may go
  job.py            one process per host under JAX's runtime: the job joined, this process's part
  consensus.py      the processes' rounds through JAX's key-value store: exchange, agree, barrier
  rendezvous.py     a job's processes meet process 0 before JAX's runtime joins them
  staging.py        staging and the one commit, for one process or all of a job
  global_arrays.py  convert across processes: arrays on the global mesh, their CRC-32 shares
  dealing.py        export across processes: the files dealt out by bytes
"""
