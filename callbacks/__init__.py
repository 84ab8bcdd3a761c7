"""Callbacks: code that watches or steers a run at named moments."""

from callbacks.base import Callback
from callbacks.checkpoint import ModelCheckpoint

__all__ = ["Callback", "ModelCheckpoint"]
