"""Example steps that honour lowtide's step contract (docs/architecture.md §6.2), runnable without GPUs:

- ``python -m lowtide.examples.prep``: writes a deterministic synthetic data set;
- ``python -m lowtide.examples.train``: a pure-Python trainer that checkpoints on SIGTERM,
  exits non-zero when interrupted and resumes from its checkpoint;
- ``python -m lowtide.examples.eval``: scores the trained model.

They are used by `examples/jobs/*.yaml`, the templates in `examples/templates/`, the demo and
the tests; copy them as a starting point for real steps. Must not: import the rest of lowtide.
"""
