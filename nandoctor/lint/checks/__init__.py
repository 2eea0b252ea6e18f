"""The checks, one module per cause id, each ending in `CHECK = Check(...)`.

Importing this package registers nothing: `lint.registry.CHECKS` lists every check, in
the order docs/lint.md and SARIF show them.
"""
