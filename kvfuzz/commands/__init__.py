"""The ``kvfuzz`` subcommands, one module each: ``register(subparsers)`` adds the command's parser and sets its
``handler``, which ``kvfuzz.cli.main`` calls with the parsed arguments and whose return is the exit status.
``options`` holds what several commands share.
"""
