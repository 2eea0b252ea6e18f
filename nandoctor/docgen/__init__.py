"""Generators of the docs pages that read several registries at once.

docs/causes.md shows, per cause id, its rule (causes), its what-if fix (causes' fix plans),
its math patch (runtime) and its lint check (lint): only a package above all of them may
import all four, so the generator lives here rather than in `causes`, which sits below
lint and may not import it. Nothing at run time imports this package.
"""
