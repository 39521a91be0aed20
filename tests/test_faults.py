"""Damaged and unusual checkpoints, through the real command line: one table.

Each row damages a copy of a real Tunix run (written by google-tunix, see
tests/data/tunix) and says what every tool must then do: the exit status, a
message naming what broke, no traceback, the source untouched and nothing
written where convert was pointed. The next damaged-checkpoint case is one
more row.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
ENV = {**{k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}, 'JAX_PLATFORMS': 'cpu'}
COMMANDS = ('inspect', 'convert', 'diff')


def snapshot(root: pathlib.Path) -> dict[str, tuple]:
  """Every entry under `root`: file bytes and times, directory listings, links."""
  out = {}
  for dirpath, dirnames, filenames in os.walk(root):
    out[dirpath] = ('dir', tuple(sorted(dirnames + filenames)), os.stat(dirpath).st_mtime_ns)
    for name in filenames + dirnames:
      path = os.path.join(dirpath, name)
      if os.path.islink(path):
        out[path] = ('link', os.readlink(path))
      elif os.path.isfile(path) and os.stat(path).st_size < (1 << 20):
        st = os.stat(path)
        with open(path, 'rb') as f:
          out[path] = (hashlib.sha256(f.read()).hexdigest(), st.st_mtime_ns)
  return out


def _truncate(path: pathlib.Path, keep: float = 0.5) -> None:
  data = path.read_bytes()
  path.write_bytes(data[: int(len(data) * keep)])


def _data_files(item: pathlib.Path) -> list[pathlib.Path]:
  return [p for p in item.rglob('*') if p.is_file() and p.parent.name == 'd']


def _nest_deeply(path: pathlib.Path) -> None:
  path.write_text('{"tree_metadata": ' + '[' * 10_000 + ']' * 10_000 + '}')


def _add_phantom_leaves(path: pathlib.Path, n: int = 20_000) -> None:
  """Leaves in _METADATA that have no array data (e.g. a bad merge)."""
  meta = json.loads(path.read_text())
  entry = next(iter(meta['tree_metadata'].values()))
  for i in range(n):
    keys = ('phantom', str(i), 'value')
    meta['tree_metadata'][repr(keys)] = {
        'key_metadata': [{'key': k, 'key_type': 2} for k in keys],
        'value_metadata': entry['value_metadata'],
    }
  path.write_text(json.dumps(meta))


def _record_handler(typestr: str) -> Callable[[pathlib.Path], None]:
  def make(step: pathlib.Path) -> None:
    meta_file = step / '_CHECKPOINT_METADATA'
    meta = json.loads(meta_file.read_text())
    meta['item_handlers']['model_params'] = typestr
    meta_file.write_text(json.dumps(meta))

  return make


def _replace_with_dangling_link(item: pathlib.Path) -> None:
  shutil.rmtree(item)
  item.symlink_to(item.parent / 'nowhere')


def _replace_with_file(item: pathlib.Path) -> None:
  shutil.rmtree(item)
  item.write_text('x')


def _sparse(path: pathlib.Path, size: int) -> None:
  with open(path, 'r+b') as f:
    f.truncate(size)  # A hole: no disk used, but stat says `size`.


def _link_to_dev_zero(path: pathlib.Path) -> None:
  path.unlink()
  path.symlink_to('/dev/zero')


def _data_iterator(step):
  """An item `iter` saved by a handler this package does not know, with no _METADATA
  (grain's iterator state, as MaxText saves it beside `items`)."""
  (step / 'iter').mkdir()
  (step / 'iter' / 'process_0-of-1.json').write_text('{"next_index": 3}')
  _record_handler_of('iter', 'grain._src.python.checkpoint_handlers.CheckpointHandler')(step)


def _record_handler_of(item, typestr):
  def make(step):
    meta_file = step / '_CHECKPOINT_METADATA'
    meta = json.loads(meta_file.read_text())
    meta['item_handlers'][item] = typestr
    meta_file.write_text(json.dumps(meta))

  return make


@dataclasses.dataclass(frozen=True)
class Fault:
  """One damaged checkpoint and what each tool must do with it.

  Attributes:
    name: the case.
    make: damages the step directory of a fresh copy.
    message: a regex the error must match (it must name the step too).
    exits: per command (inspect, convert, diff), the exit status; None
      where the outcome depends on where the damage falls (still no
      traceback, nothing written).
  """

  name: str
  make: Callable[[pathlib.Path], None]
  message: str
  exits: tuple[int | None, int | None, int | None] = (2, 2, 2)


FAULTS = [
    # An absent item: inspect shows the rest (with a note); the whole-step
    # tools name it (tests/test_partial_steps.py covers asking for less).
    Fault('model_params missing', lambda s: shutil.rmtree(s / 'model_params'), r'model_params',
          (0, 2, 2)),
    Fault('model_params without _METADATA', lambda s: (s / 'model_params' / '_METADATA').unlink(),
          r'model_params'),
    Fault('model_params a dangling symlink', lambda s: _replace_with_dangling_link(s / 'model_params'),
          r'model_params'),
    Fault('model_params a file', lambda s: _replace_with_file(s / 'model_params'), r'model_params'),
    Fault('optimizer_state missing', lambda s: shutil.rmtree(s / 'optimizer_state'),
          r'optimizer_state', (0, 2, 2)),
    Fault('truncated _METADATA', lambda s: _truncate(s / 'model_params' / '_METADATA'), r'_METADATA'),
    Fault('non-tree _METADATA', lambda s: (s / 'optimizer_state' / '_METADATA').write_text('[1, 2]'),
          r'_METADATA'),
    Fault('_METADATA nested 10^4 deep', lambda s: _nest_deeply(s / 'model_params' / '_METADATA'),
          r'_METADATA.*nested'),
    Fault('_METADATA linked to /dev/zero', lambda s: _link_to_dev_zero(s / 'model_params' / '_METADATA'),
          r'_METADATA.*regular file, found a device'),
    Fault('_METADATA of 2 GiB', lambda s: _sparse(s / 'model_params' / '_METADATA', 2 << 30),
          r'_METADATA.*larger than'),
    Fault('_METADATA lists leaves with no array data',
          lambda s: _add_phantom_leaves(s / 'model_params' / '_METADATA'), r'no array data'),
    Fault('invalid _CHECKPOINT_METADATA', lambda s: (s / '_CHECKPOINT_METADATA').write_text('{"item_h'),
          r'_CHECKPOINT_METADATA'),
    Fault('list _CHECKPOINT_METADATA', lambda s: (s / '_CHECKPOINT_METADATA').write_text('[]'),
          r'_CHECKPOINT_METADATA'),
    Fault('recorded handler is JSON', _record_handler(
        'orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler'),
          r'JsonCheckpointHandler'),
    Fault('deleted array data',
          lambda s: [shutil.rmtree(d) for d in list((s / 'model_params').rglob('d'))],
          r'model_params'),
    Fault('zero-byte array data',
          lambda s: [p.write_bytes(b'') for p in _data_files(s / 'model_params')],
          r'model_params', (None, 2, 2)),
    # Not damage: an item of a handler unknown here with no _METADATA (a data
    # iterator's state) cannot be read, and --item leaves it out.
    Fault('data iterator item of an unknown handler', _data_iterator,
          r"cannot read: 'iter' \(grain.*--item"),
    Fault('truncated array data',
          lambda s: [_truncate(p) for p in _data_files(s / 'model_params')],
          r'model_params.*(missing or damaged|another step)', (None, 2, 2)),
]


@pytest.fixture(scope='module')
def pristine(tunix_data, tmp_path_factory):
  """An undamaged copy, the other side of every diff."""
  root = tmp_path_factory.mktemp('pristine') / 'run'
  shutil.copytree(tunix_data / 'adapter_inject', root)
  return root / '1'


def run_cli(*argv: object) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, '-m', 'orbax_tunix.cli', *map(str, argv)],
      capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300,
  )


@pytest.mark.parametrize('fault', FAULTS, ids=[f.name for f in FAULTS])
def test_damaged_step(fault, tunix_data, tmp_path, pristine):
  root = tmp_path / 'run'
  shutil.copytree(tunix_data / 'adapter_inject', root, symlinks=True)
  step = root / '1'
  fault.make(step)
  before = snapshot(root)
  out = tmp_path / 'out'
  argvs = {
      'inspect': ('inspect', step),
      'convert': ('convert', step, out / '1'),
      'diff': ('diff', step, pristine),
  }
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    done = dict(zip(COMMANDS, pool.map(lambda c: run_cli(*argvs[c]), COMMANDS), strict=True))
  for command, expected in zip(COMMANDS, fault.exits, strict=True):
    result = done[command]
    where = f'{command}: exit {result.returncode}\n{result.stderr}'
    assert 'Traceback' not in result.stderr, where
    if expected is not None:
      assert result.returncode == expected, where
    if result.returncode == 2:
      assert str(step) in result.stderr, where
      assert re.search(fault.message, result.stderr, re.S), where
  assert snapshot(root) == before, 'the source was written to'
  assert not out.exists(), 'convert wrote something'



# --- hostile inputs beside damaged steps ------------------------------------------
#
# Each row builds its inputs from real Tunix runs under `src/` (snapshotted:
# bytes, times, listings and links must be unchanged after every command) and
# says, per command run on them, the exit status and what its output must
# say. A command that fails prints one message and nothing else.


@dataclasses.dataclass(frozen=True)
class Run:
  """One command line: `{name}` in an argument is a path the row built (`out` too)."""

  argv: tuple[str, ...]
  exit: int
  says: str = ''
  never_says: str = ''


@dataclasses.dataclass(frozen=True)
class Hostile:
  """An unusual or hostile input and what each command must do with it.

  Attributes:
    name: the case.
    build: `(src, data) -> paths`: makes the inputs under `src` from the
      committed fixtures in `data`; returns the named paths the runs use.
    runs: the commands and their outcomes.
  """

  name: str
  build: Callable[[pathlib.Path, pathlib.Path], dict[str, pathlib.Path]]
  runs: tuple[Run, ...]


def _linked_run(src, data):
  run = src / 'run'
  shutil.copytree(data / 'sft_full', run)
  (src / 'link').symlink_to(run)  # link -> run
  (src / 'other').mkdir()
  (src / 'other' / '2').symlink_to(run / '2')  # A step of the run under another name.
  return {'run': run, 'link': src / 'link', 'step_link': src / 'other' / '2',
          'via': src / 'other' / '..' / 'link'}


def _linked_rl_run(src, data):
  run = src / 'rl'
  shutil.copytree(data / 'rl_actor', run)
  (src / 'link').symlink_to(run / 'actor')
  return {'rl': run, 'link': src / 'link'}


def _copy(name, step_dirs=()):
  def build(src, data):
    run = src / 'run'
    shutil.copytree(data / name, run)
    for made in step_dirs:
      made(run)
    return {'run': run}

  return build


def _empty_roots(src, data):
  del data
  for root in ('e1', 'e2'):
    for step in ('1', '5'):
      (src / root / step).mkdir(parents=True)
  (src / 'e3' / '4').mkdir(parents=True)
  (src / 'e3' / '4' / 'notes.txt').write_text('not a step')
  return {'e1': src / 'e1', 'e2': src / 'e2', 'e3': src / 'e3'}


def _extra_entries(run):
  (run / '1' / 'custom').mkdir()
  (run / '1' / 'iter').mkdir()
  (run / '1' / 'iter' / 'process_0-of-1.json').write_text('{"next_index": 3}')


def _out_of_float16(src, data):
  del data
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  tree = {'ok': np.ones(4, np.float32), 'w': np.array([1e5, 1.0, np.inf, np.nan], np.float32)}
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(src / 'run' / '1', args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree)))
  return {'run': src / 'run'}


def _qlora_inputs(src, data):
  """QLoRA runs made hostile: a quantized weight's scale that does not tile it, one with no
  scale (edited copies of a real run, by plain Orbax); a plain-LoRA full save and a QLoRA
  adapters-only save with their bases; a pre-quantized Hub copy's config.json."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  from tests import builders  # pylint: disable=g-import-not-at-top

  part = 'layers/0/mlp/down_proj/kernel/array/{}/value'
  edits = {'untiled': lambda raw: raw.__setitem__(part.format('scale'),
                                                  np.ones((3, 40), np.float32)),
           'no_scale': lambda raw: raw.pop(part.format('scale'))}
  paths = {}
  for name, edit in edits.items():
    builders.edited_copy(data / 'hf_gemma3_qlora_int8' / '3', src / name, edit)
    paths[name] = src / name
  for name in ('lora_qwix_full', 'lora_base', 'hf_qwen3_qlora_int4_only', 'hf_qwen3'):
    shutil.copytree(data / name, src / name)
    paths[name] = src / name
  config = {'architectures': ['Qwen3ForCausalLM'], 'model_type': 'qwen3', 'vocab_size': 96,
            'hidden_size': 40, 'intermediate_size': 56, 'num_hidden_layers': 2,
            'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 12,
            'tie_word_embeddings': False,
            'quantization_config': {'quant_method': 'bitsandbytes', 'load_in_4bit': True}}
  (src / 'hub_4bit').mkdir()
  (src / 'hub_4bit' / 'config.json').write_text(json.dumps(config))
  return {**paths, 'hub_4bit': src / 'hub_4bit'}


def _hf_configs(src, data):
  """Two runs (qwen3 with an lm_head, llama3 tied) and Hugging Face folders for --hf-config,
  each hostile in one way; the folders are under `src`, so never written to."""
  shutil.copytree(data / 'hf_qwen3', src / 'qwen3')
  shutil.copytree(data / 'hf_llama3', src / 'llama3')
  qwen3 = {'architectures': ['Qwen3ForCausalLM'], 'model_type': 'qwen3', 'vocab_size': 96,
           'hidden_size': 40, 'intermediate_size': 56, 'num_hidden_layers': 2,
           'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 12,
           'tie_word_embeddings': False}
  configs = {
      'array': '[]', 'null': 'null', 'text5': '{"text_config": 5}',
      'llama': json.dumps({**qwen3, 'architectures': ['LlamaForCausalLM'], 'model_type': 'llama'}),
      'strvocab': json.dumps({**qwen3, 'vocab_size': '96'}),
      'floatvocab': json.dumps({**qwen3, 'vocab_size': 96.0}),
      'broken': json.dumps(qwen3)[:40],
      'untied': json.dumps({**qwen3, 'architectures': ['LlamaForCausalLM'],
                            'model_type': 'llama'}),  # The llama3 fixture is tied.
      'tie_absent': json.dumps({k: v for k, v in qwen3.items() if k != 'tie_word_embeddings'}
                               | {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama'}),
      'bf16': json.dumps({**qwen3, 'torch_dtype': 'bfloat16'}),  # The fixture is float32.
      **{name: json.dumps(qwen3) for name in ('zero', 'fifo', 'dangling', 'ok')},
  }
  paths = {}
  for name, text in configs.items():
    d = src / 'hf' / name
    d.mkdir(parents=True)
    (d / 'config.json').write_text(text)
    (d / 'vocab.json').write_text('{"a": 0}')
    paths[name] = d
  (src / 'hf' / 'dir' / 'config.json').mkdir(parents=True)
  paths['dir'] = src / 'hf' / 'dir'
  (paths['zero'] / 'tokenizer.json').symlink_to('/dev/zero')  # Read: memory runs out.
  os.mkfifo(paths['fifo'] / 'tokenizer.json')  # Read: waits forever.
  (paths['dangling'] / 'tokenizer.json').symlink_to(paths['dangling'] / 'gone.json')
  return {**{f'hf_{n}': p for n, p in paths.items()}, 'qwen3': src / 'qwen3',
          'llama3': src / 'llama3'}


def _out_dirs(src, data):
  """A run, and folders an export or a convert --force must never replace (under `src`:
  the snapshot proves them unchanged, byte for byte)."""
  shutil.copytree(data / 'hf_qwen3', src / 'run')
  mine = src / 'mine'  # An export someone keeps in git, with notes.
  (mine / '.git').mkdir(parents=True)
  (mine / '.git' / 'HEAD').write_text('ref: refs/heads/main\n')
  (mine / 'notes').mkdir()
  (mine / 'notes' / 'eval.md').write_text('accuracy 0.71\n')
  (mine / 'model.safetensors').write_bytes(b'weights I keep')
  (mine / 'config.json').write_text('{}')
  project = src / 'project'
  (project / 'src').mkdir(parents=True)
  (project / 'config.json').write_text('{}')
  step = src / 'steps' / '1'  # A step with a git repository and notes in it.
  shutil.copytree(data / 'hf_qwen3' / '1', step)
  (step / '.git').mkdir()
  (step / '.git' / 'HEAD').write_text('ref: refs/heads/main\n')
  (step / 'notes').mkdir()
  (step / 'notes' / 'eval.md').write_text('loss 1.2\n')
  return {'run': src / 'run', 'mine': mine, 'project': project, 'step': step}


def _lookalikes(src, data):
  """A step and an export this package wrote (its record in them), each copied with one
  entry it did not write added, named as Orbax or an export names its own; and an Orbax
  step that this package did not write. --force must replace none of them."""
  shutil.copytree(data / 'hf_qwen3', src / 'run')
  made = {'step': src / 'mine' / 'step', 'export': src / 'mine' / 'export'}
  for argv in (('convert', src / 'run', made['step']),
               ('export', src / 'run', made['export'], '--model', 'qwen3')):
    done = run_cli(*argv)
    assert done.returncode == 0, done.stderr
  paths = {'run': src / 'run', 'orbax_step': src / 'orbax' / '1'}
  shutil.copytree(data / 'hf_qwen3' / '1', paths['orbax_step'])  # Written by Orbax.
  extras = {
      'notes': ('step', '_NOTES.md', None), 'backup': ('step', '_backup', 'old.txt'),
      'metadata': ('step', 'notes', 'metadata'), 'd': ('step', 'd', 'mine.bin'),
      'tokenizer': ('export', 'tokenizer.json', None),
      'generation': ('export', 'generation_config.json', None),
  }
  for name, (kind, entry, inner) in extras.items():
    paths[name] = src / 'copies' / name
    shutil.copytree(made[kind], paths[name])
    if inner is None:
      (paths[name] / entry).write_text('mine\n')
    else:
      (paths[name] / entry).mkdir()
      (paths[name] / entry / inner).write_text('mine\n')
  return paths


OVERLAP = 'overlaps the source checkpoint'
NOT_OURS = 'package did not write'

HOSTILE = [
    Hostile('a symlink to the run as DST or SRC', _linked_run, (
        Run(('convert', '{run}', '{link}/2', '--force'), 2, OVERLAP),
        Run(('convert', '{link}', '{run}/2', '--force'), 2, OVERLAP),
        Run(('convert', '{run}/2', '{link}/3'), 2, OVERLAP),
        Run(('convert', '{run}', '{step_link}', '--force'), 2, OVERLAP),
        Run(('convert', '{run}/2', '{via}/7'), 2, OVERLAP),
        Run(('convert', '{link}/1', '{src}', '--force'), 2, 'holding the source step'),
        Run(('convert', '{link}/1', '{out}/1'), 0),
    )),
    Hostile('a symlink into an RL run', _linked_rl_run, (
        Run(('convert', '{link}/1', '{rl}/critic/1'), 2, OVERLAP),
        Run(('convert', '{rl}', '{link}/2'), 2, OVERLAP),
    )),
    Hostile('DST named like an unfinished step', _copy('sft_full'), (
        Run(('convert', '{run}', '{out}/5.orbax-checkpoint-tmp-1'), 2, 'named like an unfinished'),
        Run(('convert', '{run}', '{out}/5.orbax-tunix-new-1'), 2, 'named like an unfinished'),
    )),
    Hostile('roots of empty numbered directories', _empty_roots, (
        Run(('diff', '{e1}', '{e2}'), 2, r'only empty step directories \(1, 5\)'),
        Run(('inspect', '{e1}'), 2, 'only empty step directories'),
        Run(('inspect', '{e3}', '--json'), 2, 'only empty step directories'),
        Run(('convert', '{e1}', '{out}/1'), 2, 'only empty step directories'),
        Run(('diff', '{e1}/5', '{e2}/5'), 2, 'found an empty directory'),
    )),
    Hostile('a stray empty newer step', _copy('sft_full', [lambda r: (r / '9').mkdir()]), (
        Run(('inspect', '{run}'), 0, r'step +2 .*skipped step directory 9: it is empty'),
        Run(('convert', '{run}', '{out}/2'), 0, 'note: skipped step directory 9'),
        Run(('diff', '{run}', '{run}/2'), 0, 'match'),
        Run(('inspect', '{run}', '--step', '9'), 2, 'step 9 is an empty directory'),
    )),
    Hostile('two directories for one step', _copy(
        'sft_full', [lambda r: shutil.copytree(r / '2', r / '0002')]), (
        Run(('inspect', '{run}'), 2,
            r'step 2 is held by 2 directories.*reads 0002 with step_format_fixed_length=4;'
            r' 2 with its default options'),
        Run(('diff', '{run}', '{run}/2'), 2, 'held by 2 directories'),
        Run(('inspect', '{run}/0002'), 0, 'step +2'),
        Run(('inspect', '{run}', '--step', '1'), 0, 'step +1'),
    )),
    Hostile('an unfinished newer step', _copy(
        'sft_full', [lambda r: shutil.copytree(r / '2', r / '3.orbax-checkpoint-tmp-5')]), (
        Run(('convert', '{run}', '{out}/2'), 0,
            r'note: skipped unfinished step 3 \(3.orbax-checkpoint-tmp-5\)'),
        Run(('convert', '{run}', '{out}/3', '--params-only', '--layout', 'maxtext'), 0,
            'note: skipped unfinished step 3'),
    )),
    Hostile('entries the step does not record', _copy('adapter_inject', [_extra_entries]), (
        Run(('convert', '{run}', '{out}/1'), 0, r'note: left out custom/, iter/: in the step'),
        Run(('inspect', '{run}'), 0, 'left out custom/, iter/'),
    )),
    Hostile('a data iterator item of a handler unknown here', _copy(
        'adapter_inject', [lambda r: _data_iterator(r / '1')]), (
        Run(('inspect', '{run}'), 2, r"cannot read: 'iter' \(grain.*--item", 'incomplete'),
        Run(('convert', '{run}', '{out}/1'), 2, r"cannot read: 'iter'.*--item", 'incomplete'),
        Run(('inspect', '{run}', '--item', 'model_params', '--item', 'optimizer_state'), 0),
    )),
    Hostile('LoRA scaling that is not a finite number', _copy('lora_qwix'), (
        Run(('convert', '{run}', '{out}/1', '--merge-lora', '--lora-alpha', 'nan'), 2,
            'expected a finite number'),
        Run(('convert', '{run}', '{out}/1', '--merge-lora', '--lora-alpha', 'inf'), 2,
            'expected a finite number'),
        Run(('convert', '{run}', '{out}/1', '--merge-lora', '--lora-scale=-inf'), 2,
            'expected a finite number'),
    )),
    Hostile('LoRA options without --merge-lora', _copy('lora_qwix_full'), (
        Run(('convert', '{run}', '{out}/1', '--lora-alpha', '4'), 2,
            '--lora-alpha is an option of a LoRA merge'),
        Run(('convert', '{run}', '{out}/1', '--lora-scale', '2'), 2, '--lora-scale is an option'),
        Run(('convert', '{run}', '{out}/1', '--base', '{run}'), 2, '--base is an option'),
    )),
    Hostile('QLoRA parts damaged, recipes where no QLoRA run could be', _qlora_inputs, (
        Run(('inspect', '{untiled}'), 2, r"layers/0/mlp/down_proj/kernel: saved quantized by qwix"
            r".*scale \(3, 40\) float32.*scale's axis 0 \(3\) does not tile qvalue's \(56\)"),
        Run(('convert', '{no_scale}', '{out}/1'), 2,
            r'found parts that are not one weight\'s: qvalue \(56, 40\) int8, zero_point'
            r' \(14, 40\) int8: no scale'),
        Run(('export', '{untiled}', '{out}/2', '--model', 'gemma3', '--merge-lora',
             '--lora-alpha', '3'), 2, "does not tile"),
        Run(('convert', '{lora_qwix_full}', '{out}/3', '--merge-lora', '--lora-alpha', '3',
             '--base', '{lora_base}', '--base-qtype', 'int8'), 2,
            r'--base-qtype int8 given, but the save holds the base of 4 adapted weights in float'),
        Run(('convert', '{hf_qwen3_qlora_int4_only}', '{out}/4', '--merge-lora', '--lora-alpha',
             '3', '--base', '{hf_qwen3}', '--base-qtype', 'int4', '--base-tile-size', '16'), 2,
            r'--base-tile-size 16 does not fit 6 adapted weights', 'reproduce'),
        Run(('export', '{hf_qwen3}', '{out}/5', '--model', 'qwen3', '--hf-config', '{hub_4bit}'),
            0, r"note: config.json: dropped quantization_config \(quant_method 'bitsandbytes'\)"),
    )),
    Hostile('layer options a layout would ignore', _copy('sft_full'), (
        Run(('convert', '{run}', '{out}/1', '--scan-layers', 'true'), 2,
            r'--scan-layers True: the canonical layout does not take it \(only maxtext'),
        Run(('convert', '{run}', '{out}/2', '--param-scan-axis', '2'), 2,
            '--param-scan-axis 2: the canonical layout does not take it'),
        Run(('convert', '{run}', '{out}/3', '--layout', 'maxtext', '--params-only',
             '--param-scan-axis', '2'), 2,
            r'no layer axis is used\. Leave --param-scan-axis out, or pass --scan-layers too'),
        Run(('convert', '{run}', '{out}/4', '--layout', 'maxtext', '--params-only',
             '--param-scan-axis', '1'), 2, r'no scanned layers, so no layer axis is used'),
    )),
    Hostile('export --hf-config folders that are not the model\'s config', _hf_configs, (
        Run(('export', '{qwen3}', '{out}/1', '--model', 'qwen3', '--hf-config', '{hf_array}'), 2,
            r'expected a Hugging Face config.json \(a JSON object.*found a JSON array \(\[\]\)'),
        Run(('export', '{qwen3}', '{out}/2', '--model', 'qwen3', '--hf-config', '{hf_null}'), 2,
            r'found a JSON null'),
        Run(('export', '{qwen3}', '{out}/3', '--model', 'qwen3', '--hf-config', '{hf_text5}'), 2,
            r'found "text_config": 5 \(expected an object'),
        Run(('export', '{qwen3}', '{out}/4', '--model', 'qwen3', '--hf-config', '{hf_llama}'), 2,
            r"architectures: config.json has \['LlamaForCausalLM'\], the weights are"
            r" \['Qwen3ForCausalLM'\].*model_type: config.json has 'llama'"),
        Run(('export', '{qwen3}', '{out}/5', '--model', 'qwen3', '--hf-config', '{hf_strvocab}'),
            2, r"vocab_size: config.json has '96' \(str\), the weights have 96 \(int\)"),
        Run(('export', '{qwen3}', '{out}/6', '--model', 'qwen3', '--hf-config',
             '{hf_floatvocab}'), 2, r'vocab_size: config.json has 96.0 \(float\)'),
        Run(('export', '{qwen3}', '{out}/7', '--model', 'qwen3', '--hf-config', '{hf_broken}'), 2,
            r'config.json as JSON, found 40 bytes that do not parse.*Fix the file',
            'another step'),
        Run(('export', '{qwen3}', '{out}/8', '--model', 'qwen3', '--hf-config', '{hf_dir}'), 2,
            r'holding config.json \(a file\), or that config.json, found a directory'),
        Run(('export', '{llama3}', '{out}/9', '--model', 'llama3', '--hf-config', '{hf_untied}'),
            2, r'tie_word_embeddings: config.json has False, the weights have True \(no lm_head'),
        Run(('export', '{llama3}', '{out}/10', '--model', 'llama3', '--hf-config',
             '{hf_tie_absent}'), 0, r'note: config.json: wrote .*tie_word_embeddings=True'),
        Run(('export', '{qwen3}', '{out}/11', '--model', 'qwen3', '--hf-config', '{hf_zero}'), 2,
            r'tokenizer.json: expected a regular file to copy from --hf-config, found a device'),
        Run(('export', '{qwen3}', '{out}/12', '--model', 'qwen3', '--hf-config', '{hf_fifo}'), 2,
            r'tokenizer.json: expected a regular file.*found a device, pipe or socket'),
        Run(('export', '{qwen3}', '{out}/13', '--model', 'qwen3', '--hf-config',
             '{hf_dangling}'), 0, r'note: .*tokenizer.json is a link to nothing'),
        Run(('export', '{qwen3}', '{out}/14', '--model', 'qwen3', '--hf-config', '{hf_ok}'), 0),
        Run(('export', '{qwen3}', '{out}/15', '--model', 'qwen3', '--hf-config', '{hf_bf16}'), 0,
            r"note: config.json: torch_dtype='float32' \(the base config has 'bfloat16'\)"),
        Run(('export', '{qwen3}', '{out}/16', '--model', 'qwen3', '--hf-config', '{hf_bf16}',
             '--dtype', 'bfloat16'), 0, 'exported', 'torch_dtype'),
    )),
    Hostile('export and convert --force over folders holding other things', _out_dirs, (
        Run(('export', '{run}', '{mine}', '--model', 'qwen3', '--force'), 2,
            r'holds a Hugging Face export that this ' + NOT_OURS + r' \(\.git, config.json,'
            r' model.safetensors, notes.*would delete what its owner wrote'),
        Run(('export', '{run}', '{mine}', '--model', 'qwen3'), 2, NOT_OURS, '--force'),
        Run(('export', '{run}', '{project}', '--model', 'qwen3'), 2,
            r'found a directory holding config.json, src: not a Hugging Face export', '--force'),
        Run(('export', '{run}', '{project}', '--model', 'qwen3', '--force'), 2,
            'never written over'),
        Run(('convert', '{run}', '{step}', '--force'), 2,
            r'holds a checkpoint step that this ' + NOT_OURS + r' \(\.git, _CHECKPOINT'),
    )),
    Hostile('--force over entries named like Orbax\'s or an export\'s', _lookalikes, (
        Run(('convert', '{run}', '{notes}', '--force'), 2, r'also _NOTES\.md, which this ' + NOT_OURS),
        Run(('convert', '{run}', '{backup}', '--force'), 2, r'also _backup, which'),
        Run(('convert', '{run}', '{metadata}', '--force'), 2, r'also notes, which'),
        Run(('convert', '{run}', '{d}', '--force'), 2, r'also d, which'),
        Run(('convert', '{run}', '{orbax_step}', '--force'), 2,
            r'holds a checkpoint step that this ' + NOT_OURS, '--force'),
        Run(('export', '{run}', '{tokenizer}', '--model', 'qwen3', '--force'), 2,
            r'also tokenizer\.json, which'),
        Run(('export', '{run}', '{generation}', '--model', 'qwen3', '--force'), 2,
            r'also generation_config\.json, which'),
    )),
    Hostile('sizes out of range, and long destination names', _copy('hf_qwen3'), (
        Run(('export', '{run}', '{out}/1', '--model', 'qwen3', '--max-shard-size', '1e400'), 2,
            r'--max-shard-size: .1e400.: expected a positive size.*more than any disk'),
        Run(('export', '{run}', '{out}/2', '--model', 'qwen3', '--memory-budget', '0.5'), 2,
            'expected a positive size'),
        Run(('convert', '{run}', '{out}/3', '--memory-budget', 'lots'), 2,
            'expected a positive size'),
        # A legal name (255 bytes) leaves no room for a temporary suffix: it is shortened.
        Run(('export', '{run}', '{out}/' + 'e' * 255, '--model', 'qwen3'), 0, 'exported'),
        Run(('convert', '{run}', '{out}/' + 'c' * 255), 0, 'converted'),
    )),
    Hostile('values out of --dtype float16', _out_of_float16, (
        Run(('convert', '{run}', '{out}/1', '--dtype', 'float16'), 2,
            r'state/w: 1 of 4 values are outside the range of float16 \(largest magnitude'
            r' 100000; float16 holds at most 65504\)'),
        Run(('convert', '{run}', '{out}/2', '--dtype', 'bfloat16'), 0),
    )),
]


def _argv(run: Run, paths: dict[str, pathlib.Path]) -> list[str]:
  return [arg.format(**{k: str(v) for k, v in paths.items()}) for arg in run.argv]


@pytest.mark.parametrize('case', HOSTILE, ids=[c.name for c in HOSTILE])
def test_hostile_input(case, tunix_data, tmp_path):
  src, out = tmp_path / 'src', tmp_path / 'out'
  src.mkdir()
  paths = {**case.build(src, tunix_data), 'src': src, 'out': out}
  before = snapshot(src)
  argvs = [_argv(run, paths) for run in case.runs]
  existed = {argv[2]: os.path.lexists(argv[2]) for argv in argvs if argv[0] in ('convert', 'export')}
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    done = list(pool.map(lambda argv: run_cli(*argv), argvs))
  for run, argv, result in zip(case.runs, argvs, done, strict=True):
    where = f'{" ".join(argv)}: exit {result.returncode}\n{result.stdout}\n{result.stderr}'
    assert result.returncode == run.exit, where
    assert re.search(run.says, result.stdout + result.stderr, re.S), where
    assert not run.never_says or run.never_says not in result.stderr, where
    assert 'Traceback' not in result.stderr and 'Exception ignored' not in result.stderr, where
    if run.exit == 2:
      assert result.stderr.startswith('orbax-tunix: error: ') or 'usage:' in result.stderr, where
      assert all(not line.startswith(('WARNING', 'ERROR')) for line in result.stderr.splitlines())
      if argv[0] in ('convert', 'export'):
        assert existed[argv[2]] or not os.path.lexists(argv[2]), where
  assert snapshot(src) == before, 'the source was written to'
