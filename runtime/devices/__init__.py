"""Device backends: a base class with hooks and a registry (``cuda``, ``sim``, ``cpu``)."""

from .base import Device, DeviceError, backend, register_backend
from . import cpu, sim  # noqa: F401 - register the always-available backends

__all__ = ["Device", "DeviceError", "backend", "register_backend"]
