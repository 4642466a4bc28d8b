"""Evaluation: `nanokv eval` (cli.py, harness.py, report.py: quality against memory for KV
policies, tasks x policies x compression) and its data, pure Python so the tiny-model trainer
shares them: seeded long-context tasks (tasks.py) and the stdlib text corpus (corpus.py).
Importing the package loads nothing heavy."""
