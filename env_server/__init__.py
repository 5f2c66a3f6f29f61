"""env_server: see shared/DESIGN.md (lands with its issue)."""
