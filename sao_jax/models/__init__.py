"""Policy and critic models: the Flax decoder, decoding, checkpoints.

`from_pretrained(source, dtype=...)` is the public entry point: it returns
`(model, tokenizer)` for a Hugging Face checkpoint directory or for the
embedded default model 'smollm2-135m-instruct'. `export_pretrained` writes a
model back as a Hugging Face directory.
"""

from sao_jax.models import pretrained

from_pretrained = pretrained.from_pretrained
export_pretrained = pretrained.export_pretrained
