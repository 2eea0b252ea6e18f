"""Probes: objects the training step notifies at each phase boundary (see `base.Probe`)."""

from nandoctor.probes.base import Probe, Probes

__all__ = ["Probe", "Probes"]
