"""The TFDS builder of a JSONL prompt file (`jsonl_dataset.prepare` uses it).

Its own module so that TFDS, slow to import, is imported only by a run that
prepares or opens a JSONL dataset, never by a config check.
"""

from __future__ import annotations

import json

import numpy as np
import tensorflow_datasets as tfds


class JsonlPrompts(tfds.core.GeneratorBasedBuilder):
  """TFDS builder of one JSONL prompt file (or a train/eval pair)."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'question, answer (JSON), id, metadata (JSON).'}
  # TFDS looks for a download-checksums file next to a builder's source file;
  # nothing is downloaded here, and finding that path for a builder inside a
  # package needs `importlib_resources`, which TFDS 4.9 does not declare.
  code_path = None

  def __init__(self, *, splits: dict[str, list], **kwargs):
    """`splits`: name -> `jsonl_dataset.Record`s (none to open a prepared one)."""
    self._splits = splits
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    text = tfds.features.Text()
    return tfds.core.DatasetInfo(
        builder=self,
        description='Prompts from a local JSONL file.',
        features=tfds.features.FeaturesDict({
            'question': text, 'answer': text, 'id': text, 'metadata': text,
            'line': tfds.features.Scalar(dtype=np.int64),
        }),
        # Keep file order: index i of a split is its i-th record.
        disable_shuffling=True)

  def _split_generators(self, dl_manager):
    del dl_manager  # local files only: nothing is downloaded
    return {name: self._generate_examples(records)
            for name, records in self._splits.items()}

  def _generate_examples(self, records):
    for i, record in enumerate(records):
      yield i, {
          'question': record.question,
          'answer': json.dumps(record.answer),
          'id': record.id or '',
          'metadata': json.dumps(record.metadata),
          'line': record.line,
      }
