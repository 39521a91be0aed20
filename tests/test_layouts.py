"""The layout catalog: sink kinds are `layouts.SinkKind` values, and every kind a layout
names is one the pipeline writes."""

from __future__ import annotations

import pytest

from orbax_tunix import layouts
from orbax_tunix.tools import pipeline


def test_every_layout_names_a_sink_the_pipeline_writes():
  kinds = {layouts.get(n).sink for n in layouts.names()}
  assert kinds == set(layouts.SinkKind)
  assert set(pipeline.SINKS) == set(layouts.SinkKind)


@pytest.mark.parametrize('call', [layouts.named, layouts.options])
def test_a_bare_string_is_refused_as_a_sink_kind(call):
  # 'step' was the kind's spelling before it was a value: it would match no layout, silently.
  with pytest.raises(TypeError, match=r"sink 'step': expected a layouts.SinkKind"):
    call('step')


def test_a_layout_of_a_bare_string_sink_is_refused():
  with pytest.raises(TypeError, match="sink 'folder'"):
    layouts.Layout('x', 'x', lambda request: None, sink='folder')


def test_the_step_layouts_are_canonical_and_maxtext():
  # Independent of the catalog's code: the two Orbax step outputs README documents.
  assert set(layouts.named(layouts.SinkKind.STEP)) == {'canonical', 'maxtext'}
