"""The folder `watch` puts first on PYTHONPATH; a package only so that its
`sitecustomize.py` ships with nandoctor. Nothing imports it as `nandoctor.watch.boot`."""
