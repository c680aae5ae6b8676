"""Test helpers for slidekit and for plugin authors: the reference loop, tiny models, comparisons, and the
conformance suites for tiers, optimizers and kernel sets (a skipped check is not a pass: ``conformance``)."""
