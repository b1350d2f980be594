"""The main process's side of an epoch with workers (docs/design.md, "Data flow"):
``order`` publishes the batch order to workers through shared memory, ``completions`` reads
the fixed-size records workers send back, ``session`` wires them to the worker group and the
arena, and ``next()`` reads completions itself (no relay thread)."""
