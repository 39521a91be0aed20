"""The rewrite rules on explicit paths: each alone and combined, and their inverse."""

import pytest

from orbax_tunix.view import canonical_map


def _p(s):
  return tuple(s.split('/'))


def _plan(model, opt=None):
  items = {'model_params': frozenset(map(_p, model))}
  if opt is not None:
    items['optimizer_state'] = frozenset(map(_p, opt))
  return canonical_map.plan_step(items)


def test_value_level_alone():
  lay = _plan(['a/w/value', 'b/0/w/value'])['model_params']
  assert lay.rule_names == ('nnx_value',)
  assert lay.canonical_to_disk == {_p('a/w'): _p('a/w/value'), _p('b/0/w'): _p('b/0/w/value')}


def test_no_value_level_no_rewrite():
  lay = _plan(['a/w', 'b/value'])['model_params']
  assert lay.rewrites == () and lay.to_canonical_path(_p('a/w')) == _p('a/w')


def test_adapter_in_model_and_optimizer():
  model = ['base/l/0/w/value', 'base/emb/value']
  opt = [
      'opt_state/0/count/value',
      'opt_state/0/mu/base/l/0/w/value', 'opt_state/0/mu/base/emb/value',
      'opt_state/0/nu/base/l/0/w/value', 'opt_state/0/nu/base/emb/value',
      'step/value',
  ]
  lays = _plan(model, opt)
  assert lays['model_params'].to_canonical_path(_p('base/l/0/w/value')) == _p('l/0/w')
  o = lays['optimizer_state']
  assert o.rule_names == ('nnx_value', 'adapter_base')
  assert o.to_canonical_path(_p('opt_state/0/mu/base/emb/value')) == _p('opt_state/0/mu/emb')
  assert o.to_disk_path(_p('opt_state/0/nu/l/0/w')) == _p('opt_state/0/nu/base/l/0/w/value')
  assert o.to_canonical_path(_p('step/value')) == _p('step')


def test_own_base_module_is_kept():
  model = ['base/kernel/value', 'head/kernel/value']
  opt = ['opt_state/0/mu/base/kernel/value', 'opt_state/0/mu/head/kernel/value']
  lays = _plan(model, opt)
  assert lays['model_params'].rule_names == ('nnx_value',)
  assert lays['optimizer_state'].to_canonical_path(_p('opt_state/0/mu/base/kernel/value')) == _p(
      'opt_state/0/mu/base/kernel')


def test_sole_base_in_optimizer_that_does_not_mirror_weights_is_kept():
  model = ['base/w/value']
  opt = ['opt_state/0/mu/base/w/value', 'opt_state/0/extra/base/other/value']
  o = _plan(model, opt)['optimizer_state']
  assert o.to_canonical_path(_p('opt_state/0/mu/base/w/value')) == _p('opt_state/0/mu/w')
  assert o.to_canonical_path(_p('opt_state/0/extra/base/other/value')) == _p(
      'opt_state/0/extra/base/other')


@pytest.mark.parametrize('prefix', ['opt_state', 'opt_state/1', 'opt_state/inner_opt_state'])
def test_inject_shell_at_any_depth(prefix):
  opt = [f'{prefix}/{s}/value' for s in (
      'count', 'hyperparams/learning_rate', 'hyperparams/b1',
      'hyperparams_states/learning_rate/count', 'inner_state/0/count', 'inner_state/0/mu/w')]
  o = _plan(['w/value'], opt + ['step/value'])['optimizer_state']
  assert o.rule_names == ('nnx_value', 'inject_hyperparams')
  assert o.to_canonical_path(_p(f'{prefix}/inner_state/0/mu/w/value')) == _p(f'{prefix}/0/mu/w')
  assert o.to_disk_path(_p(f'{prefix}/0/count')) == _p(f'{prefix}/inner_state/0/count/value')
  side = {'/'.join(p) for p in o.side_paths}
  assert side == {f'{prefix}/{s}/value' for s in (
      'count', 'hyperparams/learning_rate', 'hyperparams/b1', 'hyperparams_states/learning_rate/count')}


def test_nested_shells():
  opt = ['o/count/value', 'o/hyperparams/lr/value',
         'o/inner_state/count/value', 'o/inner_state/hyperparams/lr/value',
         'o/inner_state/inner_state/mu/w/value']
  o = _plan(['w/value'], opt)['optimizer_state']
  assert o.to_canonical_path(_p('o/inner_state/inner_state/mu/w/value')) == _p('o/mu/w')
  assert o.to_disk_path(_p('o/mu/w')) == _p('o/inner_state/inner_state/mu/w/value')


def test_all_rules_combined_round_trip():
  model = ['base/layers/0/q/w/value', 'base/head/value']
  opt = [
      'opt_state/1/count/value', 'opt_state/1/hyperparams/learning_rate/value',
      'opt_state/1/inner_state/0/count/value',
      'opt_state/1/inner_state/0/mu/base/layers/0/q/w/value',
      'opt_state/1/inner_state/0/mu/base/head/value',
      'opt_state/1/inner_state/0/nu/base/layers/0/q/w/value',
      'opt_state/1/inner_state/0/nu/base/head/value',
      'step/value',
  ]
  lays = _plan(model, opt)
  for lay in lays.values():
    for disk, canon in lay.disk_to_canonical.items():
      if canon is not None:
        assert lay.to_disk_path(canon) == disk
        assert not {'value', 'base', 'inner_state'} & set(canon)
  assert len(lays['optimizer_state'].side_paths) == 2


def test_wrappers_at_several_depths_and_keys_repeated_below_them():
  # Adapter levels at two depths in one item (mu at 3, nu at 4 keys deep),
  # and a model module itself called `base` below the adapter level: only
  # the key right below an anchor is a wrapper.
  model = ['base/enc/base/w/value', 'base/head/value']
  opt = [
      'count/value', 'hyperparams/lr/value',  # A shell at the root.
      'inner_state/0/mu/base/enc/base/w/value', 'inner_state/0/mu/base/head/value',
      'inner_state/0/x/nu/base/enc/base/w/value', 'inner_state/0/x/nu/base/head/value',
  ]
  lays = _plan(model, opt)
  assert lays['model_params'].to_canonical_path(_p('base/enc/base/w/value')) == _p('enc/base/w')
  o = lays['optimizer_state']
  assert o.rule_names == ('nnx_value', 'inject_hyperparams', 'adapter_base')
  assert o.to_canonical_path(_p('inner_state/0/mu/base/enc/base/w/value')) == _p('0/mu/enc/base/w')
  assert o.to_canonical_path(_p('inner_state/0/x/nu/base/head/value')) == _p('0/x/nu/head')
  assert o.to_canonical_path(_p('hyperparams/lr/value')) is None
  assert o.to_disk_path(_p('0/x/nu/enc/base/w')) == _p('inner_state/0/x/nu/base/enc/base/w/value')
  assert o.to_disk_path(_p('0/mu/head')) == _p('inner_state/0/mu/base/head/value')


def test_sown_intermediates_leave_the_view():
  """A Tunix run of a MaxText MoE model saved after a forward pass holds the MoE block's sown
  `moe_has_overflow` (an nnx.Intermediate: a tuple, `value/0`, `value/1`): the weights keep
  their canonical names and the intermediates, no weights, leave the view."""
  model = ['base/l/0/w/value', 'base/l/0/moe/moe_has_overflow/value/0',
           'base/l/0/moe/moe_has_overflow/value/1', 'base/emb/value']
  lay = _plan(model)['model_params']
  assert lay.rule_names == ('nnx_value', 'adapter_base')
  assert lay.canonical_to_disk == {_p('l/0/w'): _p('base/l/0/w/value'),
                                   _p('emb'): _p('base/emb/value')}
