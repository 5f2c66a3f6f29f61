"""The trajectory broker (no torch here)."""
