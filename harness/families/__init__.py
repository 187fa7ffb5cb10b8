"""Model families, one package each; the contract and the registry are ``harness.family``.

Every package here defines ``FAMILY`` in its ``__init__.py`` and is found by the registry without
being listed anywhere (docs/adding-a-family.md).
"""
