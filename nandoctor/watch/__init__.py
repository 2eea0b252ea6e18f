"""`nandoctor watch -- CMD...`: the sentinel on any training script, unchanged.

Nothing is imported here: `bootstrap` runs in every watched process before torch is
imported, and must stay light. The parent side is `runner`, the child side `child`.
"""
