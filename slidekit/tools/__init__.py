"""Tools around the library, not the library: ``slidekit bench`` and its baselines, the preset model
shapes, child-process runs, ``slidekit report``.

The engine, the planner and the Trainer never import this package (``tests/test_layering.py``); it
ships in the wheel, so ``slidekit bench`` and ``slidekit report`` work from an installed package.
"""
