"""Small training runs that reproduce each failure; `configs/` points at them.

They stand in for a user's training script: nandoctor treats their frames as user code.
"""
