"""Hugging Face model families, found by name: Tunix's (or MaxText's) weights onto
`transformers` tensor names.

The families (`hf_families.py`: one `hf_naming.Family` each, named by each trainer that has
the model) are registered here and found by name or alias (`get`, `names`, `choices`); what
reads them is here too: which of a family's namings weights carry (`naming`), the family's
rules applied to weights' shapes and checked (`map_weights`), what kind of model weights are
(`describe_weights`), and the tables of maps in docs/huggingface.md (`table`, `markdown`). A new family is
one value in `hf_families.py`; `config.json` is checked in `hf_config.py`. Nothing here reads
an array.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TypeVar

from orbax_tunix import conventions, errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.mapping import lora, patterns, trainers, transforms
from orbax_tunix.mapping import stacks as stacks_lib
from orbax_tunix.mapping.as_trained import AsTrained
from orbax_tunix.mapping.hf_families import FAMILIES
from orbax_tunix.mapping.hf_naming import Family, Naming
from orbax_tunix.mapping.transforms import Shape

# What `describe_weights` calls weights of no family's model, and a LoRA save without them.
NO_MODEL = 'Orbax arrays (no known model)'
ADAPTERS_ONLY = 'LoRA adapters only (no base weights)'

T = TypeVar('T')

register, names = FAMILIES.register, FAMILIES.names


def aliases() -> dict[str, str]:
  """Every family's other names (`Family.aliases`) -> its name, in the order registered.

  Raises:
    ValueError: an alias that is a family's name or another family's alias.
  """
  out: dict[str, str] = {}
  for family in map(FAMILIES.get, names()):
    for alias in family.aliases:
      if alias in out or alias in names():
        raise ValueError(f'the {family.name} family\'s alias {alias!r} names another family'
                         f' already ({out.get(alias, alias)}); give it another alias.')
      out[alias] = family.name
  return out


def written_as_trained() -> dict[AsTrained, tuple[str, ...]]:
  """Each `as_trained` fact a config.json value reproduces (it has a `field`) -> the families
  it holds for, by name in alphabetical order (for the help of `as_trained.OPTION`)."""
  out: dict[AsTrained, list[str]] = {}
  for family in map(FAMILIES.get, names()):
    for fact in dict.fromkeys(f for n in family.namings for f in n.as_trained):
      if fact.field is not None:
        out.setdefault(fact, []).append(family.name)
  return {fact: tuple(sorted(families)) for fact, families in out.items()}


def get(name: str) -> Family:
  """The family `name` (or an alias of it) names.

  Raises:
    UnsupportedLayoutError: no such family (the message lists them).
  """
  return FAMILIES.get(aliases().get(name, name))


def choices() -> tuple[str, ...]:
  """Every name `model` takes: the families', then their aliases."""
  return (*names(), *aliases())


def _namings_by(trainer: trainers.Trainer) -> dict[str, Naming]:
  """Each family's naming by `trainer` (family name -> naming), for the families that have
  one, in the order registered."""
  return {f.name: n for f in map(FAMILIES.get, names()) if (n := f.naming_of(trainer)) is not None}


def naming(family: Family, paths: Collection[Path], where: str = '') -> Naming:
  """The family's naming by the trainer whose names the weights at `paths` carry
  (`trainers.of`; an opened step's: `step_layers.naming`).

  Raises:
    UnsupportedLayoutError: as `naming_by`.
  """
  return naming_by(family, trainers.of(paths), where)


def naming_by(family: Family, trainer: trainers.Trainer, where: str = '') -> Naming:
  """The family's naming by `trainer`.

  Raises:
    UnsupportedLayoutError: the family has no naming by that trainer (the message names the
      families that have one).
  """
  found = family.naming_of(trainer)
  if found is None:
    takers = list(_namings_by(trainer))
    kinds = ' or a '.join(n.trainer.title for n in family.namings)
    raise errors.UnsupportedLayoutError(
        f'{where}: these weights are a {trainer.title}\'s; the {family.name} family'
        f' ({family.architecture}) takes only a {kinds}\'s. Pick a family that takes this'
        f' kind (`model`: {", ".join(takers)}).'
    )
  return found


def adapters_need_config(paths: Collection[Path]) -> bool:
  """Whether a save of these weights' adapters alone takes their weights' shapes from the
  base model's config: every family's naming by their trainer flattens its kernels into the
  adapters (`Naming.lora_flattened`: MaxText's)."""
  trainer = trainers.of(paths)
  found = _namings_by(trainer).values()
  return bool(found) and all(n.lora_flattened for n in found)


def describe_weights(shapes: Mapping[Path, Shape], axis: int | None = stacks_lib.DEFAULT_AXIS
                     ) -> str:
  """What kind of model the weights are, for notes and `inspect`: e.g.
  'MaxText model (scanned, 34 layers)', 'Tunix model (tunix.models)' (only
  when they hold every weight one of the families' Tunix models has), else
  `ADAPTERS_ONLY` or `NO_MODEL`.

  Args:
    shapes: the weights.
    axis: the layer axis of stacked weights (`param_scan_axis`); None: not
      known (the count is shown as '?').
  """
  trainer = trainers.of(shapes)
  if not trainer.scans:
    paths = [p for p in shapes if not lora.is_adapter(p)]
    if not paths and shapes:
      return ADAPTERS_ONLY
    known = any(n.layers(paths) and not n.missing(paths) for n in _namings_by(trainer).values())
    return trainer.title if known else NO_MODEL
  form = layer_form(shapes) or stacks_lib.UNSCANNED
  count = form.count(shapes, stacks_lib.DEFAULT_AXIS if axis is None else axis)
  shown = '?' if (axis is None and form.scanned) or count is None else count
  return f'{trainer.title} ({form.kind}, {shown} layers)'


def model_weights(found: Mapping[Path, T]) -> tuple[dict[Path, T], list[str]]:
  """The weights without AQT's quantization state (no tensor of the model), and a note."""
  aqt = [p for p in found if conventions.is_quantization_state(p)]
  if not aqt:
    return dict(found), []
  kept = {p: o for p, o in found.items() if not conventions.is_quantization_state(p)}
  return kept, [f'left out {len(aqt)} AQT quantization leaves (e.g. {fmt(aqt[0])}): not'
                ' weights of the model']


def map_weights(family: Family, naming: Naming, shapes: Mapping[Path, Shape], where: str,
                whole: bool = True, config: Mapping[str, object] | None = None,
                option: str = 'hf_config') -> patterns.PathMap:
  """The naming's rules applied to weights (a full save's whole model, or the adapted
  weights): each weight's tensors, from shapes alone (and, for a naming's `sized` rules, the
  sizes `config` gives).

  Args:
    family, naming: the family, and its naming the weights carry (`naming`).
    shapes: the weights (per-layer form) -> shapes.
    where: the source, for messages.
    whole: the weights are the whole model (every one must be the family's, none missing);
      else some of it (the adapted weights: one at least must be the family's).
    config: the base model's config.json fields (its text model's), or None.
    option: the parameter `config` comes from, for messages.

  Raises:
    UnsupportedLayoutError: the weights are not the family's (a whole model: naming the
      unmapped and the missing; adapted weights: none of them is one of its modules).
    InvalidOptionError: sizes the naming's `sized` rules need that `config` does not give.
  """
  rules = naming.rules_for(config, shapes, where, option)
  try:
    mapped = patterns.map_paths(shapes, rules, where=where)
  except errors.UnsupportedLayoutError as e:
    raise errors.UnsupportedLayoutError(
        f"{e}\nThe weights have {family.name}'s names but not its shapes. Pick the"
        f' family the model is (`model`: {", ".join(names())}).') from e
  if whole:
    _fits(family, naming, shapes, mapped.unmatched, where)
  elif shapes and not mapped.outputs:
    raise errors.UnsupportedLayoutError(
        f'{where}: none of the adapted weights is a {family.name} module\'s (e.g.'
        f' {fmt(min(shapes))}). Pick the family the model is (`model`:'
        f' {", ".join(names())}).')
  return mapped


def _fits(family: Family, naming: Naming, shapes: Mapping[Path, Shape],
          unmatched: Sequence[Path], where: str) -> None:
  """Checks that the weights are the family's: none left unmapped, none missing.

  Raises:
    UnsupportedLayoutError: naming the first unmapped and missing weights.
  """
  missing = naming.missing(shapes)
  if unmatched or missing:
    parts = [f'{where}: these weights are not a {family.name} model\'s'
             f' ({family.architecture}):']
    if unmatched:
      parts.append(f'{len(unmatched)} weights have no {family.name} tensor:\n'
                   + errors.list_paths([fmt(p) for p in unmatched]))
    if missing:
      parts.append(f'{len(missing)} {family.name} weights are missing:\n'
                   + errors.list_paths(missing))
    parts.append(f'Pick the family the model is (`model`: {", ".join(names())}).')
    raise errors.UnsupportedLayoutError('\n'.join(parts))


def fill_absent(naming: Naming, per_layer: Mapping[Path, patterns.Mapped]
                ) -> tuple[dict[Path, patterns.Mapped], list[str]]:
  """The weights (per-layer form) with those the naming's `fills` make where a layer lacks
  them but holds their source, and one note per fill used (naming the layers).

  Raises:
    UnsupportedLayoutError: a fill's transform does not take its source's shape.
  """
  out, notes = dict(per_layer), []
  numbers = naming.layers(per_layer)
  for weight, fill in naming.fills.items():
    made = []
    for i in numbers:
      (path,) = patterns.Pattern.parse(weight.split('/')).expand({'i': [i]})
      (source,) = patterns.Pattern.parse(fill.source.split('/')).expand({'i': [i]})
      if path in out or source not in out:
        continue
      m = out[source]
      try:
        shape = fill.transform.check([m.shape])
      except transforms.TransformError as e:
        raise errors.UnsupportedLayoutError(f'{fmt(source)} {m.shape}: {e}') from e
      out[path] = patterns.Mapped(m.sources, transforms.chain(m.transform, fill.transform),
                                  shape)
      made.append(i)
    if made:
      notes.append(f'{weight.replace("{i}", "<i>")}: absent in layers {", ".join(made)}; wrote'
                   f' {fill.transform} of {fill.source.replace("{i}", "<i>")} instead:'
                   f' {fill.why}')
  return out, notes


def derive(naming: Naming, per_layer: Mapping[Path, patterns.Mapped]
           ) -> dict[Path, patterns.Mapped]:
  """The weights (per-layer form) with the naming's `derived` weights made of the weights they
  replace, in every layer holding them all (from the stored arrays: each source's own transform,
  a layer's slice, then the derived one's).

  Raises:
    UnsupportedLayoutError: the sources' shapes do not fit the transform (naming them).
  """
  out = dict(per_layer)
  for weight, made in naming.derived.items():
    for i in naming.layers(per_layer):
      path, *sources = (patterns.Pattern.parse(p.split('/')).expand({'i': [i]})[0]
                        for p in (weight, *made.sources))
      if not all(p in out for p in sources):
        continue
      parts = [out.pop(p) for p in sources]
      transform = transforms.per_input([m.transform for m in parts], made.transform)
      try:
        shape = made.transform.check([m.shape for m in parts])
      except transforms.TransformError as e:
        raise errors.UnsupportedLayoutError(
            f'{", ".join(fmt(p) for p in sources)}: {e}') from e
      out[path] = patterns.Mapped(tuple(s for m in parts for s in m.sources), transform, shape)
  return out


# --- layer forms: the families' ---------------------------------------------------------


def layer_forms() -> tuple[stacks_lib.LayerForm, ...]:
  """Every stacked form a family's naming holds its layers in, each once, in the order the
  families are registered."""
  return tuple(dict.fromkeys(
      n.form for f in map(FAMILIES.get, names()) for n in f.namings if n.form.scanned))


def layer_form(paths: Collection[Path]) -> stacks_lib.LayerForm | None:
  """The layer form of MaxText weights (`stacks.form_of` among the families' forms):
  stacked, UNSCANNED, or None (no decoder layers)."""
  return stacks_lib.form_of(paths, layer_forms())


def _meets(naming: Naming, paths: Collection[Path]) -> bool:
  """Whether per-layer MaxText weights are the naming's model: its per-layer view of them (a
  form whose stored layer holds several of the model's, gemma2's, renames them; weights it
  cannot take apart are not its) holds layers and every weight it requires."""
  try:
    per_layer = list(naming.form.unstack(dict.fromkeys(paths)))
  except errors.UnsupportedLayoutError:
    return False
  return bool(naming.layers(per_layer)) and not naming.missing(per_layer)


def scanned_form(paths: Collection[Path], where: str = '') -> stacks_lib.LayerForm:
  """The stacked form of per-layer MaxText weights: that of the families whose MaxText
  naming they meet (every weight it requires), as MaxText stores its layers
  (`LayerForm.stored`), else MaxText's plain scanned form.

  Raises:
    UnsupportedLayoutError: they meet families of different forms.
  """
  found = {n.form.stored: f.name for f in map(FAMILIES.get, names()) for n in f.namings
           if n.form.scanned and n.trainer == trainers.MAXTEXT and _meets(n, paths)}
  if len(found) > 1:
    raise errors.UnsupportedLayoutError(
        f'{where}: the weights are those of {" and ".join(sorted(found.values()))}, whose'
        f' layers MaxText stacks otherwise ({", ".join(f.name for f in found)}): expected'
        ' one. Convert the layers as they are stored.')
  return next(iter(found), stacks_lib.SCANNED_FORM)


def table(family: Family, trainer: str = trainers.TUNIX.name) -> list[tuple[str, str, str]]:
  """(source path, Hugging Face name, transform) per rule of the family's naming by one
  trainer (by name), as docs/huggingface.md shows them."""
  naming = family.naming_of(trainers.get(trainer))
  rules = () if naming is None else naming.rules + tuple(
      r for sized in naming.sized for r in sized.rules(sized.example))
  rows = []
  for rule in rules:
    source = '/'.join(k.spec for k in rule.source.keys)
    for dest, transform in rule.dests:
      shown = transform.name
      if rule.fan_out is not None:  # One transform per value of the placeholder `fan_out[0]`.
        shown = rule.transform_for(0).name.replace('index=0', f'index={{{rule.fan_out[0]}}}')
      rows.append((source, '/'.join(k.spec for k in dest.keys), shown))
  return rows


def markdown(trainer: str = trainers.TUNIX.name) -> str:
  """The table of one trainer's maps (by name): each `table` row once, with the
  families that have it (`scripts/readme_hf_maps.py` writes it into docs/huggingface.md)."""
  rows: dict[tuple[str, str, str], list[str]] = {}
  for family in map(get, names()):
    for row in table(family, trainer):
      rows.setdefault(row, []).append(family.name)

  def cell(text: str) -> str:
    return '`' + text.replace('|', '\\|') + '`'

  first = trainers.get(trainer).heading
  lines = [f'| {first} | Hugging Face | layout | families |', '|---|---|---|---|']
  lines += [f'| {cell(s)} | {cell(d)} | {t} | {", ".join(f)} |' for (s, d, t), f in rows.items()]
  return '\n'.join(lines) + '\n'


def families_markdown() -> str:
  """The table of families: per family, its `--model` names, its Hugging Face class,
  and the trainers' models it takes (MaxText's: the layer forms it reads them in)."""
  lines = ['| `--model` (aliases) | Hugging Face class | a Tunix model | a MaxText model, layers |',
           '|---|---|---|---|']
  for family in map(get, names()):
    named = ', '.join(f'`{a}`' for a in family.aliases)
    tunix = family.naming_of(trainers.TUNIX)
    maxtext = family.naming_of(trainers.MAXTEXT)
    forms = '-' if maxtext is None else (
        f'{maxtext.form.name}, unscanned' if maxtext.form.scanned else 'unscanned')
    lines.append(f'| `{family.name}`{f" ({named})" if named else ""} | `{family.architecture}`'
                 f' | {"yes" if tunix is not None else "-"} | {forms} |')
  return '\n'.join(lines) + '\n'
