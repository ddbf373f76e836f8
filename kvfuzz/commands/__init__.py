"""The ``kvfuzz`` subcommands, one module each: ``register(subparsers)`` adds the command's parser and sets its
``handler``, which ``kvfuzz.cli.main`` calls with the parsed arguments and whose return is the exit status.

``kvfuzz account`` and ``kvfuzz replay-workload`` follow the same pattern from ``kvfuzz.accounting.command`` and
``kvfuzz.workload.command``, beside the code they drive.
"""
