"""Plain training scripts, as users write them (no nandoctor in them), for `watch` tests."""
