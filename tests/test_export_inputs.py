"""Export inputs that used to give wrong answers or misleading errors (issue 36).

A config.json given as the file rather than its folder; a config whose
`vocab_size` would cut a Tunix model's trained rows; per-layer config fields
(`layer_types`) of another length than the weights' layers, whose folder
`transformers` would refuse. Every export here is of a committed google-tunix
fixture (tests/data/tunix); what `transformers` makes of a written config is
asked of `transformers` itself (the Hugging Face client venv).
"""

from __future__ import annotations

import json
import pathlib
import subprocess

import numpy as np
import pytest

from orbax_tunix.tools import export as export_lib
from tests.clients import client_env, subprocess_env
from tests.test_cli import run
from tests.test_export_hf import (
  DATA,
  HF_CONFIG_DIMS,
  HF_CONFIG_EXTRA,
  HF_CONFIG_FULL,
  Export,
  export_argv,
  raw,
  run_cli,
)


def _hf_dir(path: pathlib.Path, config: dict) -> pathlib.Path:
  path.mkdir(parents=True)
  (path / 'config.json').write_text(json.dumps(config, indent=2))
  (path / 'tokenizer.json').write_text('{"version": "1.0"}\n')
  return path


def _qwen3_config(**changes) -> dict:
  return {**HF_CONFIG_DIMS['hf_qwen3'], **HF_CONFIG_EXTRA['hf_qwen3'], **changes}


# --- issue 36.15: --hf-config DIR/config.json ---------------------------------------


def test_hf_config_may_name_the_config_file_itself(tmp_path):
  """`--hf-config DIR/config.json` is DIR: its config is checked and its tokenizer copied."""
  hf = _hf_dir(tmp_path / 'Qwen3', _qwen3_config())
  plan = export_lib.plan_export(DATA / 'hf_qwen3', tmp_path / 'out', model='qwen3',
                        hf_config=hf / 'config.json')
  assert plan.summary['config'] == str(hf / 'config.json')
  assert dict(plan.other_files) == {'config.json': hf / 'config.json',
                                    'tokenizer.json': hf / 'tokenizer.json'}


def test_hf_config_naming_another_file_says_what_to_pass(tmp_path, capsys):
  hf = _hf_dir(tmp_path / 'Qwen3', _qwen3_config())
  status, _, err = run(capsys, 'export', DATA / 'hf_qwen3', tmp_path / 'out', '--model', 'qwen3',
                       '--hf-config', hf / 'tokenizer.json')
  assert status == 2
  assert f'{hf / "tokenizer.json"}: --hf-config must be a Hugging Face model folder' in err, err
  assert 'found a file' in err and 'Not a directory' not in err, err
  assert not (tmp_path / 'out').exists()
