"""Prints the README's table of MaxText's names onto Hugging Face's, from the family values.

  python scripts/hf_maps.py     (paste into README.md's "MaxText models" part of the export
                                 section; tests/test_export_maxtext.py checks they agree)
"""

from orbax_tunix import huggingface

if __name__ == '__main__':
  print(huggingface.maxtext_markdown(), end='')
