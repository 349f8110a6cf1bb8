"""Re-export of :class:`relaygr_engine.behaviors.Behaviors` (its former home)."""
from ..behaviors import Behaviors

__all__ = ["Behaviors"]
