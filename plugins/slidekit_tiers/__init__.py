"""Bundled storage-tier plugins for slidekit: ``ram`` (host memory), ``posix`` (files, O_DIRECT), ``gds`` (kvikio).

Each module is a plugin registered through an entry point in group
``slidekit``, written exactly as a third-party tier would be.
"""
