"""The errors semijax raises for input a user can fix.

Every message starts with the field it is about ("config.layout.mlp: ..."), says what is wrong
and what is allowed. Entry points print an `InputError` as one line and exit non-zero; anything
else is a bug and keeps its traceback.
"""


class InputError(ValueError):
  """Bad input (a setting, a file, a layout) that the user can fix; the message names it."""


class ConfigError(InputError):
  """A configuration value that cannot be used; the message starts with the field name."""


class LayoutError(InputError):
  """A layout that cannot be realized; the message names the offending field."""
