"""What a run writes, and how it is read back: the run directory (config, metrics,
summary, checkpoint), the message log and the optional TensorBoard scalars.

Written by the live processes (fedbus.node) and read by the tools (fedbus.analysis,
fedbus.launch); it imports neither.
"""


class MissingExtra(RuntimeError):
    """An optional package a run asked for is not installed; the message is one line that
    names the pip command (the launchers print it as they print a ConfigError)."""


class DamagedFile(ValueError):
    """A run file that cannot be read as written; the message names the file (and line)
    and what can still be done."""
