"""Options as values (issue 54 item 3): every LoRA merge and QLoRA setting is one `Option`,
taken by one name everywhere: the keyword of each public function that merges, the flag of
each command that does (the name with dashes), and what a refusal says (the keyword to the
library's caller, the flag on the command line). Nothing here reads an array."""

from __future__ import annotations

import argparse
import typing

import pytest

import orbax_tunix as ot
from orbax_tunix import layouts
from orbax_tunix.cli import commands, parser
from orbax_tunix.cli import flags as cli_flags
from orbax_tunix.mapping import merge_options
from orbax_tunix.tools import convert, export

DATA = __import__('pathlib').Path(__file__).resolve().parent / 'data' / 'tunix'
# The names README documents for the merge and QLoRA settings (its CLI and API sections).
DOCUMENTED = ('merge_lora', 'lora_alpha', 'lora_scale', 'base', 'base_qtype', 'base_tile_size',
              'base_calibration')


def _flags(command: str) -> dict[str, argparse.Action]:
  """The flags of a command's parser, by the library name they set (their `dest`)."""
  sub = next(a for a in parser.build_parser()._actions  # noqa: SLF001 - argparse's own.
             if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
  return {a.dest: a for a in sub.choices[command]._actions}  # noqa: SLF001


def test_every_merge_setting_is_one_option_with_one_name_as_keyword_and_flag():
  assert merge_options.OPTIONS.names() == DOCUMENTED
  assert set(typing.get_type_hints(merge_options.MergeKeywords)) == set(DOCUMENTED)
  for command in ('convert', 'export'):
    actions = _flags(command)
    for option in merge_options.OPTIONS.values():
      flag = '--' + option.name.replace('_', '-')
      assert actions[option.name].option_strings == [flag], (command, option.name)
      assert cli_flags.flag_of(option) == flag
      assert cli_flags.as_flags(option.named()) == flag
  # The PEFT adapter takes the scaling by the same two options (`export --peft --lora-alpha`).
  adapter = layouts.destinations('export')[1]
  assert set(layouts.options(adapter)) >= {o.name for o in merge_options.SCALING}


@pytest.mark.parametrize('call', [
    lambda **kw: convert.plan_convert(DATA / 'lora_qwix', '/nonexistent/out', **kw),
    lambda **kw: export.plan_export(DATA / 'hf_qwen3_lora', '/nonexistent/out', model='qwen3',
                                    **kw),
    lambda **kw: ot.maxtext.restore_train_state(DATA / 'lora_qwix', {'x': 1}, **kw),
], ids=['plan_convert', 'plan_export', 'restore_train_state'])
def test_a_setting_without_a_merge_is_refused_by_its_keyword(call):
  with pytest.raises(ot.LoraError) as e:
    call(base_qtype='int8')
  assert str(e.value).startswith('`base_qtype` is an option of a LoRA merge'), str(e.value)
  assert '`merge_lora=True`' in str(e.value)
  with pytest.raises(TypeError, match='lora_base_qtype'):
    call(lora_base_qtype='int8')


def test_the_command_line_names_the_flag(capsys, tmp_path):
  status = commands.main(['convert', str(DATA / 'lora_qwix'), str(tmp_path / 'out'),
                          '--base-tile-size', '4', '--merge-lora', '--base', str(DATA)])
  err = capsys.readouterr().err
  assert status == 2, err
  assert err.startswith('orbax-tunix: error: --base-tile-size given without --base-qtype'), err
  assert '`' not in err and not (tmp_path / 'out').exists()


def test_a_recipe_without_its_base_names_base_in_every_api(tmp_path):
  """MaxText's restore took `lora_base_qtype`; it takes `base_qtype`, as the others."""
  for call in (lambda **kw: ot.restore_merged_lora(tmp_path / 'none', {}, **kw),
               lambda **kw: ot.maxtext.restore_train_state(tmp_path / 'none', {'x': 1},
                                                           merge_lora=True, **kw)):
    with pytest.raises(ot.LoraError, match='^`base_qtype=int8` without `base`'):
      call(lora_alpha=4.0, base_qtype='int8')


@pytest.mark.parametrize('call,old,new', [
    (lambda tmp, **kw: ot.restore_merged_lora(tmp / 'none', {}, **kw), 'alpha', 'lora_alpha'),
    (lambda tmp, **kw: ot.restore_merged_lora(tmp / 'none', {}, **kw), 'scale', 'lora_scale'),
    (lambda tmp, **kw: ot.export_peft_adapter(tmp / 'none', tmp / 'out', model='qwen3', **kw),
     'alpha', 'lora_alpha'),
])
def test_an_old_keyword_still_works_and_warns(tmp_path, call, old, new):
  with pytest.warns(DeprecationWarning, match=f'`{old}` is deprecated; pass `{new}`'):
    with pytest.raises(ot.LoraError, match=f'`{new}=nan`: expected a finite number'):
      call(tmp_path, **{old: float('nan')})
  with pytest.raises(TypeError, match=f'`{old}` and `{new}`'):
    call(tmp_path, **{old: 1.0, new: 1.0})


def test_maxtexts_lora_base_still_works_and_warns(tmp_path):
  with pytest.warns(DeprecationWarning, match='`lora_base` is deprecated; pass `base`'):
    with pytest.raises(ot.LoraError, match='`lora_alpha=nan`'):
      ot.maxtext.restore_train_state(tmp_path / 'none', {'x': 1}, params_only=True,
                                     lora_alpha=float('nan'), lora_base=tmp_path)
