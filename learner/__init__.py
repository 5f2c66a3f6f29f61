"""learner: see shared/DESIGN.md (lands with its issue)."""
