"""Bundled logger plugins for slidekit: ``tensorboard`` (event files) and ``wandb`` (Weights & Biases).

Each module is a lifecycle plugin registered through an entry point in group
``slidekit``, written exactly as a third-party logger would be. Both are
loaded with every run and do nothing unless ``run.report_to`` (CLI:
``--report-to``) asks for them; ``slidekit.reporting`` has what they share.
See docs/logging.md.
"""
