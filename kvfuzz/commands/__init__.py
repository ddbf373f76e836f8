"""The ``kvfuzz`` subcommands, one module each: ``register(subparsers)`` adds the command's parser and sets its
``handler``, which ``kvfuzz.cli.main`` calls with the parsed arguments and whose return is the exit status.
``options`` holds what several commands share.

Importing a command module and registering its parser imports neither torch nor Hypothesis nor the engine, so that
``kvfuzz --help`` and usage errors answer at once, and where torch cannot be imported; a handler imports what it
runs, and a command that drives tensors is wrapped in :func:`~kvfuzz.commands.options.needs_torch`.
"""
