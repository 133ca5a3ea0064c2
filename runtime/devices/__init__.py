"""Device backends: the contract (a stream protocol, a host protocol) and a registry (``cuda``, ``sim``, ``cpu``)."""

from .base import (ArraySource, Device, DeviceError, HostDevice, HostSource, PeerSource, StreamDevice, backend,
                   backends, register_backend)
from . import cpu, sim  # noqa: F401 - register the always-available backends

__all__ = ["ArraySource", "Device", "DeviceError", "HostDevice", "HostSource", "PeerSource", "StreamDevice",
           "backend", "backends", "register_backend"]
