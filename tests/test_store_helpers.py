"""What `store/` holds beside Orbax without being its API: `storage_errors`, `zarr_format`,
`loops`; checked against TensorStore's own errors and files, and asyncio's own task states."""

import asyncio
import errno
import os
import threading
from typing import Any

import numpy as np
import pytest
import tensorstore as ts

from orbax_tunix.store import loops, storage_errors, zarr_format


@pytest.mark.parametrize('text, storage', [
    ('OUT_OF_RANGE: Error reading "x/.zarray"', True),
    ('NOT_FOUND: Error opening "zarr" driver', True),
    ('DATA_LOSS: checksum mismatch', True),
    ('INVALID_ARGUMENT: dtype mismatch', False),
    ('One of device_put args was given the sharding of NamedSharding', False),
])
def test_storage_failures_are_told_from_request_errors(text, storage):
  wrapped = Exception('Encountered error while reading array index: (0,).')
  wrapped.__cause__ = ValueError(text)
  assert (storage_errors.storage_failure(wrapped) is not None) == storage
  assert storage_errors.storage_failure(FileNotFoundError('x')) is not None


def test_a_missing_array_is_a_storage_failure_named_without_its_spec(tmp_path):
  with pytest.raises(ValueError) as e:
    ts.open({'driver': 'zarr', 'kvstore': {'driver': 'file', 'path': str(tmp_path / 'gone')}},
            open=True).result()
  assert '[tensorstore_spec=' in str(e.value)  # What TensorStore appends.
  wrapped = Exception('Encountered error while reading array index: (0,).')
  wrapped.__cause__ = e.value
  assert storage_errors.storage_failure(wrapped) is e.value
  text = storage_errors.failure_text(e.value)
  assert text.startswith('NOT_FOUND: ') and text.endswith('does not exist')


def test_a_full_disk_is_told_by_errno_or_tensorstore_text():
  full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  wrapped = RuntimeError('save failed')
  wrapped.__cause__ = full
  assert storage_errors.out_of_space(wrapped) is full
  said = ValueError("RESOURCE_EXHAUSTED: Error writing: No space left on device [os_error_code='28']")
  assert storage_errors.out_of_space(said) is said
  assert storage_errors.out_of_space(PermissionError(errno.EACCES, 'denied')) is None
  assert storage_errors.os_words(said) == 'No space left on device'  # Not TensorStore's text.


def test_a_file_size_limit_is_told_by_errno_or_tensorstore_text():
  big = OSError(errno.EFBIG, os.strerror(errno.EFBIG))
  wrapped = RuntimeError('save failed')
  wrapped.__cause__ = big
  assert storage_errors.too_large(wrapped) is big and storage_errors.out_of_space(wrapped) is None
  # TensorStore's own words for it (convert under `ulimit -f`), as Orbax raises them.
  said = ValueError('OUT_OF_RANGE: Error writing "w/0" in OCDBT database at local file "/d/":'
                    ' Failed to write 88785 bytes to file 7: File too large'
                    " [os_error_code='27']")
  assert storage_errors.too_large(said) is said and storage_errors.os_words(said) == 'File too large'
  assert storage_errors.too_large(ValueError('OUT_OF_RANGE: index 9 is outside [0, 4)')) is None


@pytest.mark.parametrize('driver, written', [
    ('zarr', [2, 3]), ('zarr3', [2, 3]),
    ('zarr3', [6, 6]),  # Sharded: chunks of 2x3 inside each written 6x6.
])
def test_headers_and_chunk_keys_are_what_tensorstore_writes(tmp_path, driver, written):
  zarr3 = driver == 'zarr3'
  array = ts.open({'driver': driver, 'kvstore': {'driver': 'file', 'path': str(tmp_path)}},
                  create=True, dtype=ts.float32, shape=[5, 6],
                  chunk_layout=ts.ChunkLayout(read_chunk_shape=[2, 3], write_chunk_shape=written)).result()
  array[...] = np.arange(30, dtype=np.float32).reshape(5, 6)
  header = (tmp_path / zarr_format.header_name(zarr3)).read_bytes()
  assert zarr_format.parse_header(header, zarr3) == ((5, 6), np.dtype(np.float32), (2, 3))
  if written == [2, 3]:  # Unsharded: one file a chunk.
    keys = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob('*') if p.is_file()}
    chunks = {zarr_format.chunk_key((i, j), zarr3) for i in range(3) for j in range(2)}
    assert keys == chunks | {zarr_format.header_name(zarr3)}


def failing_call(started: list) -> Any:
  """A coroutine that fails and leaves a sibling task pending (appended to `started`), as
  Orbax's gather of array reads does when one read fails."""
  async def sibling():
    await asyncio.sleep(60)

  async def call():
    started.append(asyncio.ensure_future(sibling()))
    await asyncio.sleep(0)
    raise RuntimeError('one read failed')

  return call()


def test_run_tidily_drains_what_a_failed_coroutine_left():
  started = []

  async def answer():
    return 42

  assert loops.run_tidily(answer()) == 42
  with pytest.raises(RuntimeError, match='one read failed'):
    loops.run_tidily(failing_call(started))
  assert started[0].cancelled()


def test_run_tidily_drops_what_a_thread_posts_to_its_loop_after_it_closed():
  """TensorStore posts an operation's completion to the awaiting loop from its own thread;
  an operation cancelled by the drain can complete after the loop closed. Its post is
  dropped, not raised (TensorStore would report "Event loop is closed" as unraisable)."""
  loop, ran = [], []

  async def call():
    loop.append(asyncio.get_running_loop())
    raise RuntimeError('one write failed')

  with pytest.raises(RuntimeError, match='one write failed'):
    loops.run_tidily(call())
  assert loop[0].is_closed()
  late = threading.Thread(target=loop[0].call_soon_threadsafe, args=(ran.append, 1))
  late.start()
  late.join()
  assert loop[0].call_soon_threadsafe(ran.append, 2) is None and ran == []


def test_wait_for_threads_waits_for_those_started_since():
  before = set(threading.enumerate())
  done = threading.Event()
  thread = threading.Thread(target=lambda: (threading.Event().wait(0.3), done.set()))
  thread.start()
  loops.wait_for_threads(before)
  assert done.is_set() and not thread.is_alive()


def test_wait_for_threads_passes_over_threads_python_did_not_start():
  """A foreign thread that ran Python code (TensorStore's, calling back) is listed by
  `threading.enumerate` as a stand-in that cannot be joined; it is not waited for."""
  import _thread  # noqa: PLC0415  (a thread that threading did not start)

  before, listed, release = set(threading.enumerate()), threading.Event(), threading.Event()

  def foreign():
    threading.current_thread()  # Registers the stand-in, as any Python code there does.
    listed.set()
    release.wait(5)

  _thread.start_new_thread(foreign, ())
  listed.wait(5)
  try:
    assert any(isinstance(t, threading._DummyThread) for t in threading.enumerate())
    loops.wait_for_threads(before)
  finally:
    release.set()
