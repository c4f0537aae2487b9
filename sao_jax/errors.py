"""Failures the user can fix, which entry points report without a traceback.

`config_lib.run` (the wrapper of every `python -m sao_jax.*` entry point)
prints a `UserError`, an `OSError` (a missing file, a workdir that is a file)
and a `TimeoutError` (no batch in time) as one `error: ...` line and exits 2;
`--verbose` shows the traceback instead. Anything else is a bug and keeps its
traceback. Code that detects a bad input raises `UserError` (or a subclass,
such as `config_lib.ConfigError`) with a message that says what to change.
"""


class UserError(ValueError):
  """Bad input (a config value, a file's content, a missing secret).

  A `ValueError`, so that callers that caught the `ValueError` raised before
  this class existed keep working.
  """
